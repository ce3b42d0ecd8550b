"""Qwen3-MoE and the Qwen3-VL(-MoE) text model in the built-in engine (engines/models/moe.py,
engines/models/weight_names.py) against transformers on tiny random models (fp32, CPU): logits
through prefill and decode, greedy generation, a VL checkpoint's text answers, the checkpoint
layouts of experts, TP shards, sleep/wake and expert weight updates; the Triton grouped-GEMM
path under Triton's interpreter."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engines.builtin import TorchEngine
from engines.models.model import CausalLM, ModelConfig
from engines.models.model_builder import build_tokenizer, hf_config, make_model
from engines.models.moe import SparseMoE, moe_align
from engines.models.weight_names import load_weights, place_weight
from tests.engines.test_decode_kernel import _interpret
from tests.helpers import run

RELAY = os.path.join(os.path.dirname(sys.executable), "relay")  # the console script a user types

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (3, 9, 17, 30)]
PAGE, WIDTH = 16, 4  # the harness's KV blocks: each sequence gets WIDTH blocks of PAGE slots


def engine_model(path: str, cfg: ModelConfig | None = None) -> CausalLM:
    cfg = cfg or ModelConfig.from_dir(path)
    model = CausalLM(cfg)
    load_weights(model, path)
    return model.eval()


def paged_logits(model: CausalLM, prompts: list, steps: int) -> tuple[list, list]:
    """The engine model's logits of each prompt's next token after prefill, then ``steps``
    decode steps feeding its own greedy tokens: ([step][seq] logits, the sequences)."""
    cfg, s = model.cfg, len(prompts)
    shape = (cfg.num_layers, s * WIDTH + 1, PAGE, cfg.local_kv_heads, cfg.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    scratch = s * WIDTH * PAGE
    longest = max(map(len, prompts))
    ids = torch.zeros((s, longest), dtype=torch.int64)
    slots = torch.full((s, longest), scratch, dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
        slots[r, : len(p)] = r * WIDTH * PAGE + torch.arange(len(p))
    logits = [model.prefill(ids, torch.tensor([len(p) for p in prompts]), slots, k, v)]
    seqs = [list(p) for p in prompts]
    tables = torch.tensor([[r * WIDTH + j for j in range(WIDTH)] for r in range(s)], dtype=torch.int32)
    for _ in range(steps):
        nxt = logits[-1].argmax(-1).tolist()
        for seq, t in zip(seqs, nxt):
            seq.append(t)
        pos = torch.tensor([len(q) - 1 for q in seqs])
        logits.append(model.decode(torch.tensor(nxt), pos, torch.arange(s) * WIDTH * PAGE + pos, tables,
                                   (pos + 1).to(torch.int32), k, v))
    return logits, seqs


def hf_logits(hf, seqs: list, prompts: list) -> list:
    """transformers' next-token logits at every position the harness produced one for."""
    out = []
    with torch.no_grad():
        full = [hf(torch.tensor([q])).logits[0] for q in seqs]
    for step in range(len(seqs[0]) - len(prompts[0]) + 1):
        out.append(torch.stack([f[len(p) - 1 + step] for f, p in zip(full, prompts)]))
    return out


def worst_diff(model: CausalLM, hf, steps: int = 4) -> float:
    ours, seqs = paged_logits(model, PROMPTS, steps)
    ref = hf_logits(hf, seqs, PROMPTS)
    return max((a - b).abs().max().item() for a, b in zip(ours, ref))


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False},
                                       {"num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts_per_tok": 1}])
def test_moe_logits_equal_transformers_through_prefill_and_decode(tmp_path, overrides):
    """norm_topk_prob true and false; a dense layer between MoE layers (mlp_only_layers), top-1."""
    path = make_model("qwen3_moe", "tiny", str(tmp_path / "m"), seed=4, **overrides)
    model = engine_model(path)
    moe_layers = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert moe_layers == ([True, False, True] if "mlp_only_layers" in overrides else [True, True])
    assert model.cfg.norm_topk_prob == overrides.get("norm_topk_prob", True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert worst_diff(model, hf) < 1e-5


def _qwen2_moe_block(shared: int, norm: bool, seed: int = 0):
    cfg = transformers.Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=3,
                                      shared_expert_intermediate_size=shared, norm_topk_prob=norm)
    torch.manual_seed(seed)
    block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


def _our_block(block, tp_size: int = 1, tp_rank: int = 0) -> SparseMoE:
    """SparseMoE (rank ``tp_rank`` of ``tp_size``) with ``block``'s weights, placed by name as
    the engine loads a checkpoint (transformers 5's fused expert names)."""
    c = block.gate.weight.shape
    cfg = ModelConfig(arch="qwen3_moe", vocab_size=8, hidden_size=c[1], intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                      tie_word_embeddings=True, qk_norm=True, qkv_bias=False, max_position_embeddings=64,
                      eos_token_ids=[], num_experts=c[0], num_experts_per_tok=block.gate.top_k,
                      moe_intermediate_size=block.experts.down_proj.shape[2], norm_topk_prob=block.gate.norm_topk_prob,
                      shared_expert_intermediate_size=getattr(block, "shared_expert", None)
                      and block.shared_expert.down_proj.weight.shape[1] or 0).shard_for(tp_size, tp_rank)
    ours = SparseMoE(cfg)
    holder = type("M", (), {"cfg": cfg})()
    params = {f"model.layers.0.mlp.{n}": p for n, p in ours.named_parameters()}
    for n, t in block.state_dict().items():
        place_weight(holder, params, f"model.layers.0.mlp.{n}", t, "test")
    return ours


@pytest.mark.parametrize("norm", [True, False])
def test_a_shared_expert_layer_equals_transformers_qwen2_moe_block(norm):
    """Qwen3-MoE has no shared expert; the engine's (Qwen2-MoE style: sigmoid-gated, names
    ``shared_expert.*`` and ``shared_expert_gate``) is checked against transformers'
    Qwen2MoeSparseMoeBlock, whole and as the sum of its two tensor-parallel shards."""
    block = _qwen2_moe_block(48, norm)
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        ref = block(x)
        ours = _our_block(block)(x)
        tp = sum(_our_block(block, 2, r)(x) for r in range(2))
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5
    assert (tp - ref).abs().max().item() < 1e-5
    block.shared_expert_gate.weight.data.zero_()  # the shared expert counts: with its gate at 1/2, outputs move
    with torch.no_grad():
        assert (_our_block(block)(x) - ref).abs().max().item() > 1e-3


def test_moe_align_groups_every_assignment_once_in_single_expert_blocks():
    torch.manual_seed(0)
    for t, k, e, bm in [(1, 8, 128, 16), (5, 2, 4, 16), (40, 3, 8, 16), (100, 2, 3, 64)]:
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
        sorted_ids, block_expert = moe_align(ids, e, bm)
        assert sorted_ids.shape[0] == block_expert.shape[0] * bm
        real = sorted_ids[sorted_ids < t * k]
        assert sorted(real.tolist()) == list(range(t * k))  # each (token, slot) exactly once
        flat = ids.reshape(-1)
        for b, ex in enumerate(block_expert.tolist()):
            rows = sorted_ids[b * bm:(b + 1) * bm]
            rows = rows[rows < t * k]
            if ex < 0:
                assert rows.numel() == 0
            else:
                assert rows.numel() > 0 and bool((flat[rows.long()] == ex).all())
        used = (block_expert >= 0).sum().item()
        assert used == sum(-(-int((flat == x).sum()) // bm) for x in range(e))


def test_triton_grouped_gemm_moe_equals_the_reference_under_the_interpreter(tmp_path):
    """The fused path (moe_align + the Triton grouped GEMMs) against moe_reference across
    shapes (top-1 to top-8, more experts than tokens, row blocks of 16 and 64, N and K not
    multiples of the tile); a shared-expert layer against transformers' Qwen2-MoE block, whole
    and as the sum of two tensor-parallel ranks' shards; and
    a whole tiny Qwen3-MoE decoding through the fused kernels (decode and prefill) against
    transformers' logits."""
    path = make_model("qwen3_moe", "tiny", str(tmp_path / "m"), seed=5)
    out = _interpret(f"""
        import json, torch, transformers
        from engines.models.moe import fused_moe, moe_reference
        from tests.engines.test_moe import _our_block, _qwen2_moe_block, engine_model, worst_diff
        torch.manual_seed(0)
        worst = 0.0
        for t, h, e, i, k, bm in [(1, 64, 4, 32, 2, 16), (3, 64, 16, 32, 8, 16), (40, 48, 8, 24, 3, 16),
                                  (37, 64, 6, 40, 1, 64), (2, 96, 5, 80, 2, 64)]:
            x, gu, dn = torch.randn(t, h), torch.randn(e, 2 * i, h) * 0.2, torch.randn(e, h, i) * 0.2
            w, ids = torch.softmax(torch.randn(t, e), -1).topk(k, -1)
            out = fused_moe(x, gu, dn, w, ids, block_m=bm)
            worst = max(worst, (out - moe_reference(x, gu, dn, w, ids)).abs().max().item())
        block = _qwen2_moe_block(48, True)
        x = torch.randn(9, 64)
        with torch.no_grad():
            ref = block(x[None])[0]
            shared = (_our_block(block)(x, fused=True) - ref).abs().max().item()
            tp = sum(_our_block(block, 2, r)(x, fused=True) for r in range(2))  # on each rank's shards
            shared = max(shared, (tp - ref).abs().max().item())
        hf = transformers.AutoModelForCausalLM.from_pretrained({path!r}).eval()
        print(json.dumps([worst, shared, worst_diff(engine_model({path!r}), hf)]))
    """)
    kernel, shared, model = json.loads(out.strip().splitlines()[-1])
    assert kernel < 1e-5 and shared < 1e-5 and model < 1e-5


def hf_greedy(hf, prompt: list, n: int) -> list:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_equals_transformers(tmp_path):
    path = make_model("qwen3_moe", "tiny", str(tmp_path / "m"), seed=1)

    async def main():
        eng = TorchEngine(path, kv_cache_tokens=2048)
        res = await asyncio.gather(*(eng.generate(p, GREEDY) for p in PROMPTS))
        await eng.close()
        return res

    res = run(main(), 120)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    for p, r in zip(PROMPTS, res):
        assert r.token_ids == hf_greedy(hf, p, GREEDY["max_new_tokens"])


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "qwen3_vl"])
def test_a_vl_checkpoint_answers_a_text_prompt_as_transformers_does(tmp_path, arch):
    """The checkpoint holds ``model.language_model.*`` and a vision tower ``model.visual.*``
    (skipped); chat messages go through the checkpoint's template; mrope over text-only
    positions is plain RoPE."""
    path = make_model(arch, "tiny", str(tmp_path / "m"), seed=2)
    names = load_file(f"{path}/model.safetensors")
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.") for n in names)
    messages = [{"role": "user", "content": "What is 12 + 30? Answer briefly."}]

    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image", "image": "x"}]}]

    async def main():
        eng = TorchEngine(path, kv_cache_tokens=2048)
        res = await eng.generate(messages, {**GREEDY, "max_new_tokens": 12})
        with pytest.raises(ValueError, match="serves text only"):
            await eng.generate(image, GREEDY)
        await eng.close()
        return res

    res = run(main(), 120)
    ids = build_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    assert res.prompt_tokens == len(ids)
    assert res.token_ids == hf_greedy(hf, ids, 12)


def test_a_vl_moe_checkpoint_with_experts_stored_as_qwen_ships_them_loads(tmp_path):
    """Qwen3-VL-MoE checkpoints store fused experts transposed (gate_up_proj [E, H, 2I],
    down_proj [E, I, H]); transformers 5 writes [E, 2I, H] / [E, H, I]: both load to the same
    model (non-square shapes, so the layout is unambiguous)."""
    path = make_model("qwen3_vl_moe", "tiny", str(tmp_path / "m"), seed=6, moe_intermediate_size=16)
    tensors = load_file(f"{path}/model.safetensors")
    fused = [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused and tensors[fused[0]].shape[1] != tensors[fused[0]].shape[2]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    as_saved = engine_model(path)
    save_file({n: (t.transpose(1, 2).contiguous() if n in fused else t) for n, t in tensors.items()},
              f"{path}/model.safetensors")
    as_shipped = engine_model(path)
    for n, p in as_saved.named_parameters():
        assert torch.equal(p, dict(as_shipped.named_parameters())[n]), n
    assert worst_diff(as_shipped, hf, steps=2) < 1e-5


def _seq_answers(eng, prompts=PROMPTS) -> list:
    return [r.token_ids for r in [run(eng.generate(p, GREEDY), 60) for p in prompts]]


def test_sleep_wake_and_weight_updates_with_expert_tensors(tmp_path):
    """A discarding sleep, then an update naming experts one by one (what save_pretrained and
    real checkpoints hold) that must cover every expert; an update in transformers 5's fused
    in-memory names; one expert changed alone."""
    policy = make_model("qwen3_moe", "tiny", str(tmp_path / "p"), seed=1)
    other = make_model("qwen3_moe", "tiny", str(tmp_path / "o"), seed=2)
    tensors = load_file(f"{other}/model.safetensors")
    hf_other = transformers.AutoModelForCausalLM.from_pretrained(other).eval()
    want_other = [hf_greedy(hf_other, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    loop = asyncio.new_event_loop()

    def call(coro):
        return loop.run_until_complete(asyncio.wait_for(coro, 60))

    async def make():
        return TorchEngine(policy, kv_cache_tokens=2048, weights_mode="discard")

    eng = call(make())
    try:
        answers = lambda: [call(eng.generate(p, GREEDY)).token_ids for p in PROMPTS]  # noqa: E731
        before = answers()
        call(eng.sleep(["weights", "kv_cache"]))
        call(eng.wake(["weights"]))
        partial = {n: t for n, t in tensors.items() if n != "model.layers.1.mlp.experts.3.up_proj.weight"}
        with pytest.raises(ValueError, match=r"must cover every tensor.*layers\.1\.mlp\.experts\.3\.up_proj"):
            call(eng.update_weights([partial], 1))
        call(eng.update_weights([tensors], 2))
        call(eng.wake(["kv_cache"]))
        assert answers() == want_other != before
        # transformers 5's in-memory names: the stacked experts, [E, 2I, H] and [E, H, I]
        hf_policy = transformers.AutoModelForCausalLM.from_pretrained(policy)
        stacked = {n: p.detach() for n, p in hf_policy.named_parameters()}
        assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
        call(eng.update_weights([stacked], 3))
        assert answers() == before
        # one expert alone, in every MoE layer: the answers move, and come back with its old weights
        hit = {}
        for layer in range(2):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.0.{leaf}.weight"
                hit[name] = tensors[name] * 0 + 0.5 * torch.randn_like(tensors[name])
        call(eng.update_weights([hit], 4))
        changed = answers()
        assert changed != before
        old = load_file(f"{policy}/model.safetensors")
        call(eng.update_weights([{n: old[n] for n in hit}], 5))
        assert answers() == before
        with pytest.raises(KeyError, match="unknown tensor"):
            call(eng.update_weights([{"model.layers.0.mlp.experts.4.up_proj.weight": old[name]}], 6))
    finally:
        call(eng.close())
        loop.close()


def test_configs_of_moe_and_vl_checkpoints(tmp_path):
    cfg = ModelConfig.from_dir(make_model("qwen3_moe", "tiny", str(tmp_path / "m"), seed=0))
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 4, 2, 32)
    with pytest.raises(ValueError, match=r"4 experts do not divide over ep_size 3"):  # expert parallel over 3 ranks
        ModelConfig(**{**cfg.__dict__, "num_heads": 6, "num_kv_heads": 3}).shard_for(3, 0, 3)
    with pytest.raises(ValueError, match=r"MoE intermediate size \(32\) does not divide over 3"):
        ModelConfig(**{**cfg.__dict__, "num_heads": 6, "num_kv_heads": 3, "intermediate_size": 120}).shard_for(3, 0)
    big = hf_config("qwen3_moe", "30b-a3b")  # Qwen3-30B-A3B's shape (config only, no weights)
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads, big.head_dim,
            big.num_experts, big.num_experts_per_tok, big.moe_intermediate_size, big.vocab_size) == (
        2048, 48, 32, 4, 128, 128, 8, 768, 151936)
    with pytest.raises(ValueError, match="size '30b-a3b' is not made for qwen3"):
        hf_config("qwen3", "30b-a3b")
    vl = ModelConfig.from_hf(hf_config("qwen3_vl_moe", "tiny").to_dict())
    assert vl.arch == "qwen3_moe" and vl.norm_topk_prob and not vl.tie_word_embeddings  # HF's VL router renormalises


def test_relay_make_model_writes_moe_and_vl_moe_checkpoints(tmp_path):
    printed = []
    for arch in ("qwen3_moe", "qwen3_vl_moe"):
        p = subprocess.run([RELAY, "make-model", "--arch", arch, "--size", "tiny", "--out", str(tmp_path / arch),
                            "--seed", "3"], capture_output=True, text=True, timeout=300)  # as a user types it
        assert p.returncode == 0, p.stderr[-2000:]
        printed.append(p.stdout)
        with open(tmp_path / arch / "config.json") as f:
            assert json.load(f)["model_type"] == arch
        cfg = ModelConfig.from_dir(str(tmp_path / arch))
        assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
            "qwen3_moe", 4, 2, 32)
    assert "qwen3_vl_moe (tiny) checkpoint" in printed[1]
