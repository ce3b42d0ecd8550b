"""Config loading, seed flag names, GenRM instance normalization and its errors."""

from __future__ import annotations

import json
import logging

import pytest

from launcher.config import ConfigError, load_config, parse_overrides

pytestmark = pytest.mark.unit

BASE = {"resource": {"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]}, "colocate": True}


def cfg(**kw):
    return load_config(None, {**BASE, **kw})


def test_yaml_then_flags_override(tmp_path, monkeypatch):
    monkeypatch.setenv("MODEL_DIR", "/models")
    path = tmp_path / "x.yaml"
    path.write_text(
        "resource: {actor: [1, 8], rollout: [1, 8]}\ncolocate: true\nhf_checkpoint: ${MODEL_DIR}/q\nlr: 1.0e-5\n"
        "run_dir: ${NOPE:-/tmp/c}\n"
    )
    c = load_config(str(path), ["--lr", "3e-4", "--n-samples-per-prompt", "8", "--global-batch-size=64", "--use-tis"])
    assert c.hf_checkpoint == "/models/q" and c.run_dir == "/tmp/c"
    assert c.lr == 3e-4 and c.n_samples_per_prompt == 8 and c.global_batch_size == 64 and c.use_tis is True
    assert c.eps_clip_high == c.eps_clip  # falls back to --eps-clip


def test_unknown_key_and_flag_name_the_closest_valid_one(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown config key 'rollout_temprature'; did you mean 'rollout_temperature'"
    ):
        load_config(None, {**BASE, "rollout_temprature": 1.0})
    with pytest.raises(
        ConfigError, match=r"unknown flag --genrm-modl-path; did you mean 'genrm_model_path' \(--genrm-model-path\)"
    ):
        parse_overrides(["--genrm-modl-path", "x"])
    with pytest.raises(ConfigError, match="unknown role 'rolout'.*did you mean 'rollout'"):
        load_config(None, {"resource": {"actor": [1, 2], "rolout": [1, 2]}})


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("lr", "fast", "--lr must be a number, got 'fast'"),
        ("n_samples_per_prompt", 0, "--n-samples-per-prompt must be >= 1, got 0"),
        ("kl_loss_type", "k9", "--kl-loss-type must be one of: k1, k2, k3, low_var_kl; got 'k9'"),
        ("device", "tpu", "--device must be one of: cuda, cpu"),
        ("colocate", "maybe", "--colocate must be true or false"),
        ("resource", "{not json", "--resource must be a JSON object"),
        ("rm_type", "magic", "--rm-type must be one of: dapo, dapo-genrm, dummy"),
        ("sglang_mem_fraction_static", 1.5, r"--sglang-mem-fraction-static must be in \(0, 1\)"),
        ("global_batch_size", 30, "must be a multiple of --n-samples-per-prompt"),
        ("genrm_gateway_port", 70000, "--genrm-gateway-port must be between 0 and 65535, got 70000"),
        ("genrm_audit_rate", 5, "--genrm-audit-rate must be between 0 and 1, got 5"),
        ("genrm_audit_min_agreement", 1.5, "--genrm-audit-min-agreement must be between 0 and 1, got 1.5"),
    ],
)
def test_bad_values_say_which_key_and_what_is_allowed(key, value, message):
    extra = {"n_samples_per_prompt": 8} if key == "global_batch_size" else {}
    with pytest.raises(ConfigError, match=message):
        cfg(**{key: value}, **extra)


def test_bad_resource_entries():
    with pytest.raises(ConfigError, match=r"must be \[num_groups, gpus_per_group\]"):
        load_config(None, {"resource": {"actor": [8]}})
    with pytest.raises(ConfigError, match="has 0 GPUs; give every role at least one"):
        load_config(None, {"resource": {"actor": [1, 8], "rollout": [1, 0]}})


def test_legacy_genrm_model_path_becomes_the_default_instance():
    c = cfg(
        genrm_model_path="/m/judge",
        genrm_engine_config={"mem_fraction_static": 0.3},
        genrm_sampling_config={"temperature": 0.0},
    )
    inst = c.genrm["__default__"]
    assert inst.model_path == "/m/judge" and inst.num_gpus == 4  # from --resource genrm
    assert inst.engine_config["max_context_len"] == 8192 and inst.engine_config["mem_fraction_static"] == 0.3
    assert inst.sampling_config == {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_response_len": 4096,
        "chat_template_kwargs": {},
    }


def test_instances_win_over_legacy_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        c = cfg(genrm_model_path="/m/legacy", genrm_instances={"q": {"model_path": "/m/q", "num_gpus": 4}})
    assert list(c.genrm) == ["q"]
    assert "using --genrm-instances" in caplog.text


def test_missing_per_instance_keys_fall_back_to_global_flags():
    c = cfg(
        genrm_num_gpus_per_engine=2,
        genrm_sampling_config={"temperature": 0.5},
        genrm_instances={
            "a": {"model_path": "/a", "num_gpus": 2},
            "b": {"model_path": "/b", "num_gpus": 2, "num_gpus_per_engine": 1, "sampling_config": {"temperature": 0.0}},
        },
    )
    assert c.genrm["a"].num_gpus_per_engine == 2 and c.genrm["a"].sampling_config["temperature"] == 0.5
    assert c.genrm["b"].num_gpus_per_engine == 1 and c.genrm["b"].sampling_config["temperature"] == 0.0


@pytest.mark.parametrize(
    "instances,message",
    [
        ({"q": {"num_gpus": 4}}, "missing required key 'model_path'"),
        ({"q": {"model_path": "/q"}}, "missing required key 'num_gpus'"),
        ({"__default__": {"model_path": "/q", "num_gpus": 4}}, "'__default__' is reserved"),
        ({"q": {"model_path": "/q", "num_gpus": 1}, "s": {"model_path": "/s", "num_gpus": 1}}, "must equal the sum"),
        ({"q": {"model_path": "/q", "num_gpus": 4, "nmu_gpus": 1}}, "unknown keys"),
        ({"q": {"model_path": "/q", "num_gpus": 3, "num_gpus_per_engine": 2}}, "not a multiple"),
        ({"q": {"model_path": "/q", "num_gpus": 0}}, "must be a positive integer"),
    ],
)
def test_instance_validation_errors(instances, message):
    resource = (
        {"actor": [1, 8], "rollout": [1, 5], "genrm": [1, 3]} if "not a multiple" in message else BASE["resource"]
    )
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"resource": resource, "colocate": True, "genrm_instances": instances})


def test_instances_flag_as_json_string():
    c = load_config(
        None,
        [
            "--resource",
            json.dumps(BASE["resource"]),
            "--colocate",
            "--genrm-instances",
            json.dumps({"q": {"model_path": "/q", "num_gpus": 4}}),
        ],
    )
    assert c.genrm["q"].num_gpus == 4 and c.colocate


def test_missing_config_file_points_at_the_shipped_ones():
    with pytest.raises(ConfigError, match="torchrun_configs/"):
        load_config("no-such-config.yaml")


def test_trainer_precision_and_optimizer_flags():
    assert (cfg().bf16, cfg().optimizer_impl) == (False, "auto")  # fp32, torch AdamW at DP = 1
    c = load_config(None, {**BASE, **parse_overrides(["--bf16", "--optimizer-impl", "megatron"])})
    assert c.bf16 is True and c.optimizer_impl == "megatron"
    with pytest.raises(ConfigError, match="--optimizer-impl must be one of"):
        load_config(None, {**BASE, "optimizer_impl": "sgd"})


def test_periodic_eval_can_be_turned_off_and_checkpoints_kept_to_a_number():
    cfg = load_config("tiny-cpu-split", ["--eval-interval", "0", "--keep-checkpoints", "2"])
    assert cfg.eval_interval == 0 and cfg.keep_checkpoints == 2
    with pytest.raises(ConfigError, match="--keep-checkpoints must be >= 0"):
        load_config("tiny-cpu-split", ["--keep-checkpoints", "-1"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--rollout-top-p", "1.5"],
            "--rollout-temperature/--rollout-top-p/--rollout-max-response-len: top_p must be in (0, 1], got 1.5",
        ),
        (["--eval-top-p", "0"], "--eval-temperature/--eval-top-p: top_p must be in (0, 1], got 0.0"),
        (
            ["--genrm-sampling-config", '{"temperature": NaN}'],
            "sampling_config (--genrm-sampling-config): temperature must be a finite number",
        ),
        (["--genrm-sampling-config", '{"top_k": 2.5}'], "top_k must be -1 (off) or an integer >= 1, got 2.5 (float)"),
        (
            ["--genrm-sampling-config", '{"seed": 18446744073709551616}'],
            "seed must be an integer >= 0, or null; got an integer of 65 bits",
        ),
        (["--genrm-sampling-config", '{"tempreature": 1}'], "unknown sampling parameters ['tempreature']"),
    ],
)
def test_sampling_values_no_engine_can_run_fail_at_load_time(flags, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny-cpu-split", flags)
    assert message in str(e.value)


# ---------------------------------------------------------------------------- the original's flags


def test_the_original_systems_flags_are_accepted_with_their_meaning_or_a_notice(caplog, tmp_path):
    """Flags from the original's launch lines parse: its names for ours, its two-value
    --eval-prompt-data, its data keys; the ones that change nothing here say so once, why."""
    import logging

    from launcher.config.rules import NO_EFFECT_FLAGS, _noticed_flags

    _noticed_flags.clear()
    argv = ["--num-gpus-per-node", "4", "--hybrid", "--offload-train", "--offload-rollout", "false", "--log-passrate",
            "--reward-num-workers", "16", "--input-key", "problem", "--label-key", "answer", "--micro-batch-size", "1",
            "--save", "/ckpt", "--sglang-config", "sglang.yaml", "--train-memory-margin-bytes", "1073741824",
            "--selective-offload", "--manual-offload", "--megatron-to-hf-mode", "bridge", "--eval-prompt-data", "aime",
            "aime.jsonl", "--use-fault-tolerance",
            "--max-global-restart", "2", "--use-kl-loss", "--kl-loss-type", "low_var_kl", "--use-tis"]
    with caplog.at_level(logging.WARNING, logger="relay.config"):
        cfg = load_config(None, argv)
        load_config(None, argv)  # once per process
    assert (cfg.gpus_per_node, cfg.input_key, cfg.label_key) == (4, "problem", "answer")
    assert (cfg.eval_prompt_name, cfg.eval_prompt_data) == ("aime", "aime.jsonl")
    assert cfg.fault_tolerant and cfg.max_global_restart == 2
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == len(NO_EFFECT_FLAGS) and all("has no effect here: " in n for n in notices), notices
    assert "--save has no effect here: checkpoints go to RUN_DIR/checkpoints: set --run-dir" in notices
    with pytest.raises(ConfigError, match="--inference-defer-roles .* is not built here; defer the judge with "
                                          "--rm-type dummy --defer-reward-to-post-process"):
        load_config(None, ["--inference-defer-roles", "genrm"])
    with pytest.raises(ConfigError, match="--reward-runtime .* is not built here"):
        load_config(None, ["--reward-runtime", "remote"])
    with pytest.raises(ConfigError, match="unknown flag --no-such-flag"):
        load_config(None, ["--no-such-flag", "1"])


def test_the_legacy_judge_gets_one_gpu_by_default_as_in_the_original():
    cfg = load_config(None, ["--genrm-model-path", "/j", "--resource", '{"actor": [1, 4], "rollout": [1, 3]}'])
    assert cfg.genrm["__default__"].num_gpus == 1
    cfg = load_config(None, ["--genrm-model-path", "/j", "--resource",
                             '{"actor": [1, 4], "rollout": [1, 2], "genrm": [1, 2]}'])
    assert cfg.genrm["__default__"].num_gpus == 2


def test_data_rows_are_read_under_the_input_and_label_keys(tmp_path):
    from launcher.data import DataError, load_rows

    p = tmp_path / "d.jsonl"
    p.write_text('{"problem": "1+1?", "answer": "2", "source": "x"}\n')
    (row,) = load_rows(str(p), input_key="problem", label_key="answer")
    assert (row.prompt, row.label, row.metadata) == ("1+1?", "2", {"source": "x"})
    with pytest.raises(DataError, match=r"needs an object with a 'prompt' .*\(another key: --input-key KEY\)"):
        load_rows(str(p))


def test_a_judge_sampling_config_with_several_answers_per_request_is_refused():
    with pytest.raises(ConfigError, match=r"\(--genrm-sampling-config\): n must be 1: the judge answers"):
        load_config(None, ["--genrm-model-path", "/j", "--genrm-sampling-config", '{"n": 2}'])


def test_an_empty_value_unsets_an_optional_text_key_set_in_yaml():
    cfg = load_config("tiny-cpu-defer", ["--custom-reward-post-process-path", ""])
    assert cfg.custom_reward_post_process_path is None
    assert load_config("tiny-cpu-defer").custom_reward_post_process_path is not None
    with pytest.raises(ConfigError, match="--rm-type must be one of"):
        load_config(None, ["--rm-type", "nonsense"])


def test_expert_parallel_flags_and_their_errors(tmp_path):
    """--expert-model-parallel-size and --moe-aux-loss-coeff (the original's Megatron flag
    names): EP must divide the data-parallel size and the checkpoint's experts."""
    flags = ["--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01"]
    c = load_config(None, {**BASE, **parse_overrides(flags)})
    assert c.expert_model_parallel_size == 2 and c.moe_aux_loss_coeff == 0.01
    assert cfg().expert_model_parallel_size == 1 and cfg().moe_aux_loss_coeff == 0.0  # the original's defaults
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size 3 must divide the trainer's data-parallel "
                                          r"size 4 \(8 actor GPUs / --tensor-model-parallel-size 2\)"):
        cfg(expert_model_parallel_size=3, tensor_model_parallel_size=2)
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for d, n in ((moe, 6), (dense, 0)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": n}))
    assert cfg(expert_model_parallel_size=2, hf_checkpoint=str(moe)).expert_model_parallel_size == 2
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size 4 must divide the 6 experts of"):
        cfg(expert_model_parallel_size=4, hf_checkpoint=str(moe))
    with pytest.raises(ConfigError, match=r"is a dense model \(no experts\); use 1"):
        cfg(expert_model_parallel_size=2, hf_checkpoint=str(dense))
    with pytest.raises(ConfigError, match=r"is a mixture-of-experts model: training .* needs Megatron's sequence "
                                          r"parallelism"):
        cfg(tensor_model_parallel_size=2, hf_checkpoint=str(moe))
    assert cfg(tensor_model_parallel_size=2, hf_checkpoint=str(dense)).tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="--expert-model-parallel-size must be >= 1, got 0"):
        cfg(expert_model_parallel_size=0)


def test_a_hybrid_policy_trains_only_without_tensor_parallel(tmp_path):
    """The trainer trains Qwen3.5 hybrids at TP 1 (data and expert parallel): a hybrid
    policy with TP 2 is a ConfigError naming the flag; with TP 1 it plans."""
    hybrid = tmp_path / "q35"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {}}))
    with pytest.raises(ConfigError, match=r"is a qwen3_5 hybrid model .*trains it without tensor parallel.*; use "
                                          r"--tensor-model-parallel-size 1 \(got 2\)"):
        cfg(hf_checkpoint=str(hybrid), tensor_model_parallel_size=2)
    assert cfg(hf_checkpoint=str(hybrid)).hf_checkpoint == str(hybrid)


@pytest.mark.parametrize("flag", ["--expert-model-parallel-size", "--moe-aux-loss-coeff"])
def test_hostile_moe_flag_values_give_a_config_or_a_config_error(flag):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None)
    @given(st.one_of(st.text(max_size=12), st.integers(-10**6, 10**6).map(str), st.floats().map(repr)))
    def check(value):
        try:
            c = load_config(None, {**BASE, **parse_overrides([flag, value])})
        except ConfigError:
            return
        assert c.expert_model_parallel_size >= 1 and 8 % c.expert_model_parallel_size == 0  # divides DP = 8
        assert 0 <= c.moe_aux_loss_coeff < float("inf")

    check()
    for bad in ("nan", "inf", "-inf", "1e400"):  # no float flag takes a non-finite value (--lr nan neither)
        with pytest.raises(ConfigError, match="must be a finite number"):
            load_config(None, {**BASE, **parse_overrides(["--moe-aux-loss-coeff", bad])})
        with pytest.raises(ConfigError, match="--lr must be a finite number"):
            load_config(None, {**BASE, "lr": float(bad)})


def test_the_originals_training_math_flags_are_taken_with_their_meaning():
    c = load_config(None, {**BASE}, )
    # defaults: the original's per-sample aggregation, normalized advantages, Adam's defaults,
    # evaluation at the rollout temperature
    assert (c.calculate_per_token_loss, c.disable_rewards_normalization, c.disable_grpo_std_normalization) == (
        False, False, False)
    assert (c.adam_beta1, c.adam_beta2, c.adam_eps) == (0.9, 0.999, 1e-8)
    assert c.eval_temperature == c.rollout_temperature == 1.0
    c = load_config(None, ["--resource", json.dumps(BASE["resource"]), "--colocate", "--calculate-per-token-loss",
                           "--adam-beta1", "0.8", "--adam-beta2", "0.98", "--adam-eps", "1e-6",
                           "--disable-rewards-normalization", "--rollout-temperature", "0.7"])
    assert c.calculate_per_token_loss and c.disable_rewards_normalization
    assert (c.adam_beta1, c.adam_beta2, c.adam_eps) == (0.8, 0.98, 1e-6)
    assert c.eval_temperature == 0.7  # follows the rollout's unless given
    assert load_config(None, {**BASE, "rollout_temperature": 0.7, "eval_temperature": 0.0}).eval_temperature == 0.0


def test_training_that_would_learn_nothing_or_miscount_steps_is_refused_at_start():
    from launcher.config.checks import check_training_math

    with pytest.raises(ConfigError, match="--rollout-temperature 0 .* every advantage is 0"):
        check_training_math(cfg(rollout_temperature=0.0))
    with pytest.raises(ConfigError, match="--global-batch-size 96 does not divide the 256 samples"):
        check_training_math(cfg(rollout_batch_size=32, n_samples_per_prompt=8, global_batch_size=96))
    check_training_math(cfg(rollout_batch_size=32, n_samples_per_prompt=8, global_batch_size=64))


def test_the_originals_launch_script_flags_take_their_meaning():
    c = cfg()
    assert (c.rollout_shuffle, c.rollout_seed, c.sampling_seed) == (False, None, c.seed)  # file order, as the original
    c = cfg(rollout_shuffle=True, rollout_seed=42)
    assert c.rollout_shuffle and c.sampling_seed == 42
    c = load_config(None, ["--resource", json.dumps(BASE["resource"]), "--colocate", "--use-dynamic-batch-size",
                           "--max-tokens-per-gpu", "4608", "--apply-chat-template-kwargs", '{"enable_thinking": false}',
                           "--eval-reward-key", "acc", "--metadata-key", "extra_info"])
    assert c.micro_batch_tokens == 4608 and c.chat_template_kwargs == {"enable_thinking": False}
    assert c.eval_reward_key == "acc" and c.metadata_key == "extra_info"
    with pytest.raises(ConfigError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu"):
        cfg(use_dynamic_batch_size=True)
    assert parse_overrides(["--custom-generate-function-path", "my.rollout.generate"]) == {
        "custom_generate_function_path": "my.rollout.generate"}


def test_did_you_mean_only_for_a_real_likeness():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["--use-mlflow"])
    assert "did you mean" not in str(e.value)  # --use-wandb was: "did you mean --use-tis" (now a flag of its own)
    assert parse_overrides(["--use-wandb"]) == {"use_wandb": True}
    with pytest.raises(ConfigError, match="did you mean 'rollout_shuffle'"):
        parse_overrides(["--rollout-shufle"])


def test_prompts_come_in_file_order_unless_shuffled_and_the_seed_picks_the_order():
    from launcher.data import PromptOrder, Row

    rows = [Row(i, f"q{i}", str(i)) for i in range(10)]
    assert [r.index for r in PromptOrder(rows, 1, shuffle=False).batch(1, 4)] == [4, 5, 6, 7]
    a, b = (PromptOrder(rows, seed, shuffle=True).batch(0, 10) for seed in (1, 2))
    assert sorted(r.index for r in a) == list(range(10)) and [r.index for r in a] != [r.index for r in b]


def test_several_named_eval_sets_in_the_originals_form():
    c = load_config(None, ["--eval-prompt-data", "aime", "a.jsonl", "math500", "b.jsonl", "--lr", "1e-5"])
    assert c.eval_sets == [("aime", "a.jsonl"), ("math500", "b.jsonl")] and c.lr == 1e-5
    assert load_config(None, ["--eval-prompt-data", "a.jsonl"]).eval_sets == [("eval", "a.jsonl")]
    assert load_config(None, {"eval_prompt_sets": {"gsm": "g.jsonl"}}).eval_sets == [("gsm", "g.jsonl")]
