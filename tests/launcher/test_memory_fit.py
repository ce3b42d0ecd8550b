"""The plan-time memory estimate (launcher/memory_fit.py): each engine's weights and one
full-length context per GPU against its memory fraction; a layout that cannot fit is
refused by ``relay plan`` with the arithmetic, an unreadable model or unknown GPU memory is
said to be not checked, and the estimate from config.json agrees with real checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.allocator import PlanError, make_plan
from launcher.config import load_config
from launcher.memory_fit import model_size

pytestmark = pytest.mark.unit
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")

#: a 70B dense model's shape (Llama-3-70B), bf16: ~141 GB of weights
DENSE_70B = {"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "torch_dtype": "bfloat16"}


#: a small policy (its trainer fits an 80 GB GPU easily): the engine tests' other model
SMALL = {**DENSE_70B, "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 16,
         "intermediate_size": 2048, "vocab_size": 32000}


def model_dir(path, config: dict, weight_bytes: int = 0) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if weight_bytes:  # a sparse file: its size is the checkpoint's, no disk used
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.truncate(weight_bytes)
    return str(path)


def plan(policy: str, judge: str, *extra: str):
    return make_plan(load_config("qwen3-4b-8gpu-colocate-split", ["--hf-checkpoint", policy, "--genrm-model-path",
                                                                  judge, "--gpu-memory-gb", "80", *extra]))


def test_a_judge_that_cannot_fit_its_gpus_is_refused_with_the_arithmetic(tmp_path):
    policy = model_dir(tmp_path / "policy", SMALL)
    judge = model_dir(tmp_path / "judge", DENSE_70B)
    with pytest.raises(PlanError) as e:
        plan(policy, judge, "--genrm-num-gpus-per-engine", "1")
    said = str(e.value)
    assert said.startswith("genrm[__default__] engines cannot fit: weights 131.")
    assert "(estimated from config.json) / 1 GPU(s)" in said
    assert "KV of one max_context_len context (8,192 tokens x 320.0 KiB)" in said  # 2 x 80 layers x 8 heads x 128 x 2 B
    assert "x 80.0 GiB" in said and "(--gpu-memory-gb 80)" in said and "--genrm-num-gpus-per-engine" in said
    # over 4 GPUs (tensor parallel) the same judge fits, and the plan shows the numbers
    fits = plan(policy, judge, "--genrm-num-gpus-per-engine", "4", "--resource",
                '{"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]}')
    (line,) = [m for m in fits.memory if m.startswith("memory fit of genrm")]
    assert "/ 4 GPU(s) = 32." in line and "8,192 tokens x 80.0 KiB" in line and "room for" in line


def test_the_checkpoints_own_bytes_count_and_a_long_context_alone_can_refuse(tmp_path):
    small = {**DENSE_70B, "num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 2048, "vocab_size": 1000}
    policy = model_dir(tmp_path / "policy", small)
    judge = model_dir(tmp_path / "judge", small, weight_bytes=70 << 30)
    with pytest.raises(PlanError, match=r"weights 70.0 GiB / 1 GPU\(s\) = 70.00 GiB per GPU"):
        plan(policy, judge, "--genrm-num-gpus-per-engine", "1")
    light = model_dir(tmp_path / "light", {**small, "head_dim": 128}, weight_bytes=1 << 30)  # 2 x 2 x 8 x 128 x 2 B
    kv = r"KV of one max_context_len context \(10,000,000 tokens x 8.0 KiB\) = 76.29 GiB"
    with pytest.raises(PlanError, match=kv):
        plan(policy, light, "--genrm-engine-config", '{"max_context_len": 10000000}')
    assert any(m.startswith("memory fit of rollout: weights") for m in plan(policy, light).memory)


def test_an_unreadable_model_or_unknown_gpu_memory_is_said_to_be_not_checked(tmp_path):
    policy = model_dir(tmp_path / "policy", SMALL)
    lines = plan(policy, str(tmp_path / "nowhere")).memory
    assert f"memory fit of genrm[__default__]: not checked (cannot read {tmp_path}/nowhere/config.json)" in lines
    p = subprocess.run([RELAY, "plan", "--config", "qwen3-4b-8gpu-colocate-split", "--hf-checkpoint", policy],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PATH=os.path.dirname(RELAY)))
    assert p.returncode == 0, p.stderr  # no nvidia-smi on the PATH: the GPU's memory is unknown
    assert "memory fit of rollout: not checked (no --gpu-memory-gb and no GPU on this machine; say --gpu-memory-gb N)" \
        in p.stdout


def test_relay_plan_refuses_the_layout_before_anything_starts(tmp_path):
    judge = model_dir(tmp_path / "judge", DENSE_70B)
    p = subprocess.run([RELAY, "plan", "--config", "qwen3-4b-8gpu-colocate-split", "--genrm-model-path", judge,
                        "--gpu-memory-gb", "80"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "relay plan: invalid layout:\ngenrm[__default__] engines cannot fit: weights" in p.stderr


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5_moe"])
def test_the_estimate_from_config_json_is_within_a_tenth_of_real_checkpoints(tmp_path, arch):
    from engines.models.model_builder import make_model

    path = make_model(arch, "tiny", str(tmp_path / arch), dtype="bfloat16")
    measured = model_size(path)
    assert measured.measured
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    estimated = model_size(path)
    assert not estimated.measured
    assert 0.9 < estimated.weight_bytes / measured.weight_bytes < 1.1, (estimated, measured)


#: Qwen3-4B's shape
QWEN3_4B = {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 2560, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def test_the_trainers_fit_grows_with_the_micro_batchs_tokens_and_recompute_brings_it_back(tmp_path):
    policy = model_dir(tmp_path / "policy", QWEN3_4B)
    judge = model_dir(tmp_path / "judge", {**QWEN3_4B, "num_hidden_layers": 4})
    ok = plan(policy, judge, "--bf16", "--micro-batch-tokens", "4096", "--rollout-max-response-len", "4096")
    (line,) = [m for m in ok.memory if m.startswith("memory fit of the trainer")]
    assert "4.02B params / TP 1 x 7.5 B (weights, grads, optimizer)" in line and "activations of 4,096 tokens" in line
    long = ("--bf16", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "65536")
    with pytest.raises(PlanError, match=r"the trainer cannot fit: .* activations of 65,536 tokens \(36 layers x "
                                        r"141\.0 KiB per token\) = 317\.25 GiB.*--recompute-granularity full"):
        plan(policy, judge, *long)
    again = plan(policy, judge, *long, "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1")
    assert any("full recompute: layer inputs + one layer" in m for m in again.memory)
    big = model_dir(tmp_path / "big", DENSE_70B)  # its rollout engines over 8 GPUs fit; its trainer does not
    with pytest.raises(PlanError, match=r"the trainer cannot fit: 70\.\d+B params / TP 1"):
        plan(big, judge, "--bf16", "--rollout-num-gpus-per-engine", "4")


#: Qwen3-0.6B's shape
QWEN3_06B = {**QWEN3_4B, "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16,
             "intermediate_size": 3072}


def test_without_a_micro_batch_size_the_plan_shows_the_automatic_one_and_a_given_one_stays(tmp_path):
    """No --micro-batch-tokens: the plan's trainer line says the size the trainer will pick on
    an 80 GB GPU (the 0.6B shape: 32,768 tokens; the 4B shape over 8 data-parallel ranks:
    fewer); a given size, or an MoE model (not measured: the old 8,192), is planned as is."""
    small = model_dir(tmp_path / "small", QWEN3_06B)
    judge = model_dir(tmp_path / "judge", {**QWEN3_4B, "num_hidden_layers": 4})
    trainer_line = lambda p: next(m for m in p.memory if m.startswith("memory fit of the trainer"))  # noqa: E731
    line = trainer_line(plan(small, judge, "--bf16"))
    assert "activations of 32,768 tokens" in line and line.endswith("(micro-batch tokens automatic: 32,768; the "
                                                                     "trainer sizes them on its own GPU)"), line
    line = trainer_line(plan(small, judge, "--bf16", "--micro-batch-tokens", "16384"))
    assert "activations of 16,384 tokens" in line and "automatic" not in line, line
    line = trainer_line(plan(model_dir(tmp_path / "4b", QWEN3_4B), judge, "--bf16"))
    assert "micro-batch tokens automatic: 6,144" in line, line  # 8 DP ranks: 7.5 B a parameter, 5.1 MB a token
    moe = model_dir(tmp_path / "moe", {**QWEN3_06B, "model_type": "qwen3_moe", "num_experts": 8,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 768})
    line = trainer_line(plan(moe, judge, "--bf16"))
    assert "activations of 8,192 tokens" in line and "automatic" not in line, line
