"""Qwen3.5's hybrid text model (``qwen3_5_moe``: Gated DeltaNet linear attention between
gated full-attention layers, MoE with a shared expert) in the built-in engine, against
transformers on tiny random checkpoints (fp32, CPU, the reference path): logits through a
prefill and 20 decode steps, a preemption that recomputes the recurrent state, greedy
generation through the engine (a preempting one, shared prompts), sleep/wake, weight
updates; the config, the MTP head and ``relay make-model``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engines.builtin import TorchEngine
from engines.models.hybrid_model import HybridCausalLM, build_causal_lm
from engines.models.linear_attention import CHUNK, state_shapes
from engines.models.model import ModelConfig
from engines.models.model_builder import hf_config, make_model
from engines.models.weight_names import load_weights
from tests.helpers import run

RELAY = os.path.join(os.path.dirname(sys.executable), "relay")  # the console script a user types

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
#: lengths: shorter than the conv kernel, around it, and past one prefill chunk
PROMPTS = [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (2, 5, 17, CHUNK + 6)]
PAGE, WIDTH = 16, 10  # the harness's KV blocks: each sequence gets WIDTH blocks of PAGE slots


def hybrid_model(path: str, seed: int) -> str:
    """A tiny qwen3_5_moe checkpoint whose weights move the logits enough for a 1e-5 check to
    see a wrong term: projections at std 0.05, and the norms, ``dt_bias`` and ``A_log`` moved off
    their initial values (zero-centred norms at 0 would hide a missing ``1 +``)."""
    make_model("qwen3_5_moe", "tiny", path, seed=seed, initializer_range=0.05)
    tensors = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    moved = {n: t + 0.3 * torch.randn(t.shape, generator=gen) if any(k in n for k in ("norm", "dt_bias", "A_log"))
             else t for n, t in tensors.items()}
    save_file(moved, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    return {"policy": hybrid_model(str(root / "policy"), 1), "other": hybrid_model(str(root / "other"), 2)}


def hf_model(path: str):
    return transformers.AutoModelForImageTextToText.from_pretrained(path).eval()


def engine_model(path: str) -> HybridCausalLM:
    model = build_causal_lm(ModelConfig.from_dir(path))
    load_weights(model, path)
    return model.eval()


class Harness:
    """The engine model's own prefill/decode over a paged KV cache and a state pool, as the
    runner drives them: sequence ``r`` in KV blocks ``[r * WIDTH, (r + 1) * WIDTH)`` and state row
    ``rows[r]`` (scattered on purpose)."""

    def __init__(self, model: HybridCausalLM, n: int):
        cfg = self.cfg = model.cfg
        self.model = model
        kv = (cfg.kv_layers, 2 * n * WIDTH + 1, PAGE, cfg.local_kv_heads, cfg.head_dim)
        self.k, self.v = torch.zeros(kv), torch.zeros(kv)
        conv, rec = state_shapes(cfg)
        lin = cfg.num_layers - cfg.kv_layers
        self.state = (torch.zeros(lin, 2 * n + 1, *conv), torch.zeros(lin, 2 * n + 1, *rec))
        self.rows = torch.tensor([2 * n - 1 - 2 * r for r in range(n)])
        self.blocks = torch.arange(n) * WIDTH

    def prefill(self, seqs: list, which: list) -> torch.Tensor:
        """Prefill sequences ``which`` (indices) from their whole tokens ``seqs[i]``."""
        longest = max(len(seqs[i]) for i in which)
        ids = torch.zeros((len(which), longest), dtype=torch.int64)
        slots = torch.full((len(which), longest), self.k.shape[1] - 1, dtype=torch.int64)
        for r, i in enumerate(which):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            slots[r, : len(seqs[i])] = self.blocks[i] * PAGE + torch.arange(len(seqs[i]))
        lens = torch.tensor([len(seqs[i]) for i in which])
        return self.model.prefill(ids, lens, slots, self.k, self.v, self.state, self.rows[which])

    def decode(self, seqs: list) -> torch.Tensor:
        pos = torch.tensor([len(q) - 1 for q in seqs])
        tables = (self.blocks[:, None] + torch.arange(WIDTH)).to(torch.int32)
        return self.model.decode(torch.tensor([q[-1] for q in seqs]), pos, self.blocks * PAGE + pos, tables,
                                 (pos + 1).to(torch.int32), self.k, self.v, self.state, self.rows)


def hf_logits(hf, seqs: list, prompts: list) -> list:
    """transformers' next-token logits ([step][seq]) at every position the harness produced one for."""
    with torch.no_grad():
        full = [hf(torch.tensor([q])).logits[0] for q in seqs]
    return [torch.stack([f[len(p) - 1 + step] for f, p in zip(full, prompts)])
            for step in range(len(seqs[0]) - len(prompts[0]) + 1)]


def test_logits_equal_transformers_through_prefill_and_20_decode_steps_with_a_preemption(models):
    """A batch of prompts of different lengths (shorter than the conv kernel, past a prefill
    chunk) prefilled together, then 20 decode steps on their own greedy tokens. After step 8
    one sequence is preempted: its state row and KV blocks are wiped and it moves to other
    ones; prefilled again from all its tokens, its recurrent and conv state are recomputed,
    and its next 12 steps still equal transformers' logits."""
    model, hf = engine_model(models["policy"]), hf_model(models["policy"])
    h = Harness(model, len(PROMPTS))
    seqs = [list(p) for p in PROMPTS]
    ours = [h.prefill(seqs, list(range(len(seqs))))]
    for step in range(20):
        for q, t in zip(seqs, ours[-1].argmax(-1).tolist()):
            q.append(t)
        if step == 8:  # preempt sequence 2, re-admit it elsewhere: its state comes from its tokens alone
            victim = 2
            for t in h.state:
                t[:, h.rows[victim]] = float("nan")
            h.k[:, h.blocks[victim]:h.blocks[victim] + WIDTH] = float("nan")
            h.rows[victim], h.blocks[victim] = 2 * len(seqs), len(seqs) * WIDTH
            recomputed = h.prefill(seqs[:victim] + [seqs[victim][:-1]], [victim])
            assert (recomputed[0] - ours[-1][victim]).abs().max().item() <= 1e-5
        ours.append(h.decode(seqs))
    ref = hf_logits(hf, seqs, PROMPTS)
    assert len(ours) == len(ref) == 21
    worst = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    assert worst <= 1e-5
    assert max(r.abs().max().item() for r in ref) > 0.5  # logits that a wrong term would visibly move


def test_a_long_prompt_prefills_in_chunks_as_decode_would_step_it(models):
    """The chunked delta rule (several chunks) and the one-token recurrence agree: a prompt
    prefilled whole and the same prompt fed one token at a time give the same logits."""
    model = engine_model(models["policy"])
    prompt = [3 + (i * 11) % 100 for i in range(2 * CHUNK + 9)]
    whole = Harness(model, 1).prefill([prompt], [0])
    h = Harness(model, 1)
    h.prefill([prompt[:1]], [0])
    for n in range(2, len(prompt) + 1):
        last = h.decode([prompt[:n]])
    assert (whole - last).abs().max().item() <= 1e-5


def hf_greedy(hf, prompt: list, n: int) -> list:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_equals_transformers_also_when_preempted_and_with_shared_prompts(models):
    """Through TorchEngine: a batch of prompts; the same batch in a KV cache too small for it
    (decode runs out of blocks and preempts, the preempted are prefilled again: more prompt
    tokens run than the prompts hold); three greedy copies of one prompt admitted together
    (one prefill, the others take its state row)."""
    path = models["policy"]
    hf = hf_model(path)
    want = [hf_greedy(hf, p, GREEDY["max_new_tokens"]) for p in PROMPTS]

    async def main(tokens, prompts, sampling=GREEDY):
        eng = TorchEngine(path, kv_cache_tokens=tokens, block_size=16)
        try:
            res = await asyncio.gather(*(eng.generate(p, sampling) for p in prompts))
            return [r.token_ids for r in res], await eng.stats()
        finally:
            await eng.close()

    roomy, stats = run(main(2048, PROMPTS), 120)
    assert roomy == want
    assert stats["prefill_tokens"] == sum(map(len, PROMPTS))
    # four requests of 3 blocks each (prompt + 24 tokens) in 6 blocks: admitted with one block
    # each, they run out of blocks when they reach their second and the newest are preempted
    crowd = [[9 + (i * 5 + n) % 80 for i in range(n)] for n in (14, 9, 12, 15)]
    long = {**GREEDY, "max_new_tokens": 24}
    tight, stats = run(main(96, crowd, long), 120)
    assert tight == [hf_greedy(hf, p, 24) for p in crowd]
    assert stats["prefill_tokens"] > sum(map(len, crowd))  # someone was preempted and recomputed
    assert stats["kv_blocks_free"] == 6
    shared, stats = run(main(2048, [PROMPTS[2]] * 3 + [PROMPTS[3]]), 120)
    assert shared == [want[2]] * 3 + [want[3]]
    assert stats["prefill_tokens"] == len(PROMPTS[2]) + len(PROMPTS[3])  # the copies were not prefilled


def test_sleep_wake_and_weight_updates(models):
    """A judge-style engine (weights backed up) sleeps both tags (the state pool goes with the
    KV cache) and answers the same after waking; a rollout-style update with another
    checkpoint's tensors (VL names, per-expert experts, its MTP head skipped) answers as that
    checkpoint does; updating back restores the first answers."""
    policy, other = models["policy"], models["other"]
    want_other = [hf_greedy(hf_model(other), p, GREEDY["max_new_tokens"]) for p in PROMPTS[:3]]
    tensors = load_file(f"{other}/model.safetensors")
    assert any(n.startswith("mtp.") for n in tensors)
    loop = asyncio.new_event_loop()

    def call(coro):
        return loop.run_until_complete(asyncio.wait_for(coro, 60))

    async def make():
        return TorchEngine(policy, kv_cache_tokens=2048, weights_mode="backup")

    eng = call(make())
    try:
        answers = lambda: [call(eng.generate(p, GREEDY)).token_ids for p in PROMPTS[:3]]  # noqa: E731
        before = answers()
        call(eng.sleep(["weights", "kv_cache"]))
        stats = call(eng.stats())
        assert stats["bytes"]["kv_cache"] == 0 and eng.runner.state.conv is None
        call(eng.wake(["weights", "kv_cache"]))
        assert call(eng.stats())["bytes"]["kv_cache"] > 0
        assert answers() == before
        call(eng.update_weights([tensors], 1))
        assert answers() == want_other != before
        call(eng.update_weights([load_file(f"{policy}/model.safetensors")], 2))
        assert answers() == before
    finally:
        call(eng.close())
        loop.close()


def test_configs_tensor_parallel_refusal_and_make_model(tmp_path, models):
    cfg = ModelConfig.from_dir(models["policy"])
    assert cfg.arch == "qwen3_5_moe" and cfg.hybrid and cfg.kv_layers == 2 and cfg.rotary_dim == 8
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.norm_topk_prob and cfg.shared_expert_intermediate_size == 48
    # the checkpoint's MTP head is there, and skipped by name: the model holds no MTP weights
    assert any(n.startswith("mtp.layers.0.") for n in load_file(f"{models['policy']}/model.safetensors"))
    assert not any("mtp" in n for n in engine_model(models["policy"]).hf_names())
    with pytest.raises(ValueError, match=r"qwen3_5_moe: linear-attention key heads \(2\) do not divide over 4 "):
        cfg.shard_for(4, 0)
    # a text-only config (Qwen3_5MoeForCausalLM's model_type) reads the same
    text = hf_config("qwen3_5_moe", "tiny").text_config.to_dict()
    wrapped = ModelConfig.from_hf(hf_config("qwen3_5_moe", "tiny").to_dict())
    assert wrapped.text_prefix == "model.language_model." and ModelConfig.from_hf(text).text_prefix == "model."
    assert ModelConfig.from_hf(text) == dataclasses.replace(wrapped, text_prefix="model.")
    big = ModelConfig.from_hf(hf_config("qwen3_5_moe", "35b-a3b").to_dict())  # config only, no weights
    assert (big.hidden_size, big.num_layers, big.kv_layers, big.num_heads, big.num_kv_heads, big.head_dim,
            big.rotary_dim, big.num_experts, big.num_experts_per_tok, big.moe_intermediate_size,
            big.shared_expert_intermediate_size, big.linear_num_value_heads, big.vocab_size) == (
        2048, 40, 10, 16, 2, 256, 64, 256, 8, 512, 512, 32, 248320)
    with pytest.raises(ValueError, match="size '30b-a3b' is not made for qwen3_5_moe"):
        hf_config("qwen3_5_moe", "30b-a3b")
    out = tmp_path / "m"
    p = subprocess.run([RELAY, "make-model", "--arch", "qwen3_5_moe", "--size", "tiny", "--layers", "2", "--out",
                        str(out)], capture_output=True, text=True, timeout=300)  # as a user types it
    assert p.returncode == 0, p.stderr[-2000:]
    assert "qwen3_5_moe (tiny) checkpoint" in p.stdout
    with open(out / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3_5_moe"
    small = ModelConfig.from_dir(str(out))
    assert (small.num_layers, small.layer_types) == (2, ("linear_attention", "full_attention"))


def worst_diff(path: str, steps: int, hf=None) -> float:
    """The largest gap between the engine model's logits and transformers' (``hf``, else the
    checkpoint's) over a prefill of PROMPTS and ``steps`` decode steps."""
    h = Harness(engine_model(path), len(PROMPTS))
    seqs = [list(p) for p in PROMPTS]
    ours = [h.prefill(seqs, list(range(len(seqs))))]
    for _ in range(steps):
        for q, t in zip(seqs, ours[-1].argmax(-1).tolist()):
            q.append(t)
        ours.append(h.decode(seqs))
    ref = hf_logits(hf or hf_model(path), seqs, PROMPTS)
    return max((a - b).abs().max().item() for a, b in zip(ours, ref))


def test_the_cuda_paths_of_the_other_layers_under_the_triton_interpreter(models):
    """What runs on a GPU: the Triton paged-decode attention of the full-attention layers, the
    fused MoE and the linear-attention decode kernels (prefill: the reference), here under
    Triton's interpreter."""
    from tests.engines.test_decode_kernel import _interpret

    out = _interpret(f"""
        from engines.kernels.paged_attention import triton_usable
        from tests.engines.test_qwen35 import worst_diff
        import torch
        assert triton_usable(torch.device("cpu"))
        print(worst_diff({models["policy"]!r}, 3))
    """)
    assert float(out.strip().splitlines()[-1]) <= 1e-5


def test_a_text_only_checkpoint_loads_and_answers_as_transformers(tmp_path):
    """``Qwen3_5MoeForCausalLM``'s checkpoint: a bare ``qwen3_5_moe_text`` config and
    ``model.layers.*`` names (no ``language_model`` prefix, no vision tower)."""
    torch.manual_seed(3)
    cfg = hf_config("qwen3_5_moe", "tiny", initializer_range=0.05).text_config
    hf = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    hf.save_pretrained(str(tmp_path))
    assert ModelConfig.from_dir(str(tmp_path)).arch == "qwen3_5_moe"
    assert worst_diff(str(tmp_path), 3, hf) <= 1e-5
