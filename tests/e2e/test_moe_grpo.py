"""End to end with mixture-of-experts models: the shipped tiny MoE configs, run literally with
``relay train`` (Split and Defer-swap), build a Qwen3-MoE policy and a Qwen3-VL-MoE judge on
first use (the original's default judge type, text only) and train through the whole stack:
Megatron MoE trainer (expert parallel in Split), built-in MoE engines, weight sync of the
experts into the rollout engines, the judge engines answering. And Qwen3.5 hybrids: a hybrid
judge scoring GRPO in Split and Defer-swap, and the shipped tiny hybrid configs (hybrid policy
and judge) training the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engines.models.model_builder import first_use_arch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")  # the console script a user types
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_first_use_builds_the_architecture_the_folder_names():
    assert first_use_arch("/c/models/tiny-policy") == "qwen3"
    assert first_use_arch("/c/models/tiny-moe-policy/") == "qwen3_moe"
    assert first_use_arch("/c/models/tiny-vl-moe-judge") == "qwen3_vl_moe"
    assert first_use_arch("/c/models/tiny-hybrid-judge") == "qwen3_5_moe"


@pytest.mark.parametrize("config", ["tiny-cpu-split", "tiny-cpu-defer"])
def test_a_qwen35_hybrid_judge_scores_grpo_in_split_and_defer_swap(config, tmp_path):
    """A Qwen3.5 hybrid judge (built on first use) through relay train: inline in Split, asleep
    and woken around the deferred scoring in Defer-swap (its linear-attention state pool
    released and reallocated with the KV cache)."""
    from launcher.demo_task import write_demo_data

    cache, run_dir = str(tmp_path / "cache"), str(tmp_path / "run")
    judge = os.path.join(cache, "models", "tiny-hybrid-judge")
    data = write_demo_data(str(tmp_path / "data"))["train"]
    p = subprocess.run([RELAY, "train", "--config", config, "--prompt-data", data, "--num-rollout", "2", "--run-dir",
                        run_dir, "--genrm-model-path", judge], cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, RELAY_CACHE=cache))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(judge, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3_5_moe"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["reward/judged"] == r["samples"] > 0 for r in recs)
    with open(os.path.join(run_dir, "engine_events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    judge_events = [e["event"] for e in sorted(events, key=lambda e: e["t"]) if e["role"] == "genrm"]
    assert judge_events.count("wake") >= 2 and judge_events.count("sleep") >= 2  # around every step


MOE = ("tiny-moe-policy", "tiny-vl-moe-judge")


def train(config: str, tmp_path, models=MOE, *extra: str) -> tuple[list[dict], dict]:
    from launcher.demo_task import write_demo_data

    cache, run_dir = str(tmp_path / "cache"), str(tmp_path / "run")
    data = write_demo_data(str(tmp_path / "data"))["train"]
    env = dict(os.environ, RELAY_CACHE=cache)
    p = subprocess.run([RELAY, "train", "--config", config, "--prompt-data", data, "--num-rollout", "2", "--run-dir",
                        run_dir, *extra], cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "shut down cleanly" in p.stdout
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    types = {}
    for name in models:
        with open(os.path.join(cache, "models", name, "config.json")) as f:
            types[name] = json.load(f)["model_type"]
    return recs, types


def check(recs: list[dict], types: dict, expected=None) -> None:
    assert types == (expected or {"tiny-moe-policy": "qwen3_moe", "tiny-vl-moe-judge": "qwen3_vl_moe"})
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["sync/engine_versions"] == [r["step"]] * len(r["sync/engine_versions"])
        assert r["reward/judged"] == r["samples"] > 0  # every reward is a verdict of the MoE judge
        assert r["mem/engine_bytes_training"] == 0
    # the random judge's verdicts carry no advantage; the routers' load-balancing loss still
    # trains (moe_aux_loss_coeff in the configs), and the rollout engines answer with the new weights
    assert all(r["train/grad_norm"] > 0 and r["train/moe_load_balancing_loss"] > 0 for r in recs)
    a, b = recs[0]["sync/probe_logprobs"], recs[1]["sync/probe_logprobs"]
    assert all(x != y for x, y in zip(a, b)), (a, b)
    assert max(a) - min(a) < 1e-4, "rollout engines disagree after the same sync"


def test_moe_policy_and_vl_moe_judge_in_split(tmp_path):
    recs, types = train("tiny-cpu-moe-split", tmp_path)
    check(recs, types)
    for r in recs:
        assert r["judge/engine_requests"] > 0


def test_moe_policy_and_vl_moe_judge_in_defer_swap(tmp_path):
    recs, types = train("tiny-cpu-moe-defer", tmp_path)
    check(recs, types)


HYBRID = ("tiny-hybrid-policy", "tiny-hybrid-judge")


@pytest.mark.parametrize("config", ["tiny-cpu-hybrid-split", "tiny-cpu-hybrid-defer"])
def test_hybrid_policy_and_judge(config, tmp_path):
    """The Megatron trainer trains a Qwen3.5 hybrid policy (Gated DeltaNet layers of our own
    inside the GPTModel; expert parallel 2 in Split) and syncs it into hybrid rollout engines;
    a hybrid judge scores every sample. Split also saves the policy (--save-hf): transformers
    loads it whole (the vision tower and MTP head copied through) and gives the probe token
    the log-prob the rollout engines reported after the last sync."""
    split = config.endswith("split")
    hf_dir = str(tmp_path / "hf")
    recs, types = train(config, tmp_path, HYBRID, *(["--save-interval", "1", "--save-hf", hf_dir] if split else []))
    check(recs, types, {name: "qwen3_5_moe" for name in HYBRID})
    if split:
        check_saved_hybrid(os.path.join(hf_dir, "step_000002"), tmp_path, recs[-1])


def check_saved_hybrid(path: str, tmp_path, last: dict) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from launcher.config import load_config
    from launcher.data import load_rows, prompt_ids

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as h:
        names = set(h.keys())
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("mtp.") for n in names)
    assert "model.language_model.layers.0.linear_attn.A_log" in names
    model, info = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = load_config("tiny-cpu-hybrid-split")
    row = load_rows(str(tmp_path / "data" / "train.jsonl"))[0]
    ids = prompt_ids(tokenizer, row.prompt, cfg.apply_chat_template, cfg.chat_template_kwargs)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    token = int(logprobs.argmax())
    assert token == last["sync/probe_tokens"][0], json.dumps(last)[:500]
    assert float(logprobs[token]) == pytest.approx(last["sync/probe_logprobs"][0], abs=1e-4)
