"""Qwen3.5 hybrid models in the Megatron trainer (tiny qwen3_5_moe on CPU/gloo: Gated
DeltaNet and gated full-attention layers, MoE with a shared expert, a vision tower and an
MTP head in the checkpoint): HF <-> Megatron round trip bit-exact and logits equal
transformers' over more than one delta-rule chunk; expert parallel 2 steps like 1; a GRPO
step moves log-probs the advantage's way; the export before a step is the checkpoint's text
model under its own names, and after a step a built-in engine fed the export reproduces
the trainer's log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from engines.models.checkpoint import checkpoint_tensors
from engines.models.linear_attention import CHUNK
from engines.models.model_builder import make_model
from engines.trainer.hybrid_layers import NOT_TRAINED
from engines.trainer.train_batch import TrainBatch
from relay import this_host
from tests.helpers import run
from tests.trainer.actors import MegatronCheck
from tests.trainer.test_moe import (
    ADV,
    MASKS,
    SEQS,
    SHARDS,
    each_rank,
    engine_generate,
    merged,
    shard_batch,
    start,
    stop,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_model("qwen3_5_moe", "tiny", str(tmp_path_factory.mktemp("hybrid") / "m"), seed=3)


def test_hybrid_roundtrip_bit_exact_and_logits_match_transformers(hybrid):
    from relay import setup_torch_distributed

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        check = procs.spawn("megatron", MegatronCheck)
        out = await check.hf_roundtrip_and_logits.call_one(hybrid, CHUNK + 17).result(240)
        await procs.stop()
        return out

    r = run(main(), 380)
    assert r["missing"] == [] and r["unexpected"] == []
    assert r["exact"], "HF -> Megatron -> HF is not bit-exact"
    assert r["max_diff"] < 1e-5, r["max_diff"]


def test_hybrid_ep2_steps_like_ep1_and_the_export_drives_an_engine(hybrid):
    """Two DP ranks with different data, torch AdamW without clipping: EP=1 and EP=2 agree
    on the step's statistics and every gradient. Under EP=2: the export before the step is
    the checkpoint's text model (``model.language_model.`` names, experts per expert; no
    vision tower or MTP head); the step raises the positive-advantage sequence's log-probs;
    a built-in engine fed the export after it reproduces the trainer's log-probs."""
    opts = dict(lr=1e-2, clip_grad=0.0, optimizer="torch", micro_batch_tokens=40, moe_aux_loss_coeff=0.1)

    async def one(ep):
        procs, t = await start(hybrid, 2, ep=ep, **opts)
        initial = merged((await t.export_hf.call(4096).result(120)).values()[0])
        before = (await t.compute_logprobs.call(SEQS[:2]).result(120)).values()[0]
        stats = await each_rank(t, "train_step", [shard_batch(s) for s in SHARDS])
        grads = (await t.full_grads.call().result(120)).values()
        after = (await t.compute_logprobs.call(SEQS[:2]).result(120)).values()[0]
        engine = None
        if ep == 2:
            exported = (await t.export_hf.call(4096).result(120)).values()[0]
            r = await engine_generate(hybrid, exported, SEQS[2][:6])
            trainer_lp = (await t.compute_logprobs.call([SEQS[2][:6] + r.token_ids]).result(120)).values()[0][0][5:]
            engine = (r, trainer_lp)
        await stop(procs, t)
        return initial, before, stats, grads, after, engine

    async def main():
        return await one(1), await one(2)

    ep1, ep2 = run(main(), 390)
    for r in range(2):
        s1, s2 = ep1[2][r], ep2[2][r]
        assert s1.keys() == s2.keys() and "moe_load_balancing_loss" in s1
        for k in s1:
            assert abs(s1[k] - s2[k]) <= 1e-5 * max(1.0, abs(s1[k])), (r, k, s1[k], s2[k])
        g1, g2 = ep1[3][r], ep2[3][r]
        assert sorted(g1) == sorted(g2)
        for n in g1:
            assert (g1[n] - g2[n]).abs().max() <= 1e-5, n
    names = ep1[3][0]
    assert any(".self_attention.in_proj_qkv." in n for n in names)  # linear attention
    assert any(".self_attention.q_proj." in n for n in names)  # gated full attention
    assert any("shared_experts.gate_weight" in n for n in names) and any("local_experts" in n for n in names)

    initial, before, _, _, after, (r, trainer_lp) = ep2
    ckpt = {name: t for _, name, t in checkpoint_tensors(hybrid) if not name.startswith(NOT_TRAINED)}
    assert sorted(initial) == sorted(ckpt) and all(torch.equal(initial[n], ckpt[n]) for n in ckpt)
    assert "model.language_model.layers.0.linear_attn.A_log" in initial
    resp = lambda lp, i: sum(lp[i][3:])  # noqa: E731 (the response tokens' log-probs)
    assert ADV[0] > 0 > ADV[1] and MASKS[0][4] == 1
    assert resp(after, 0) > resp(before, 0) and resp(after, 1) < resp(before, 1)
    assert r.weight_version == 1 and len(r.token_ids) == 8
    assert max(abs(x - y) for x, y in zip(r.logprobs, trainer_lp)) < 1e-4


def test_hybrid_bf16_params_train_with_fp32_master_weights(hybrid):
    """--bf16 (the GPU run's dtype; it crashed there once: our layers' params stayed float32
    while Megatron's were bf16): every parameter, ours included, is bf16, the optimizer's
    master weights float32, and SFT steps lower the loss."""

    async def main():
        procs, t = await start(hybrid, bf16=True, lr=1e-3)
        info = await t.optimizer_info.call_one().result(60)
        dtypes = await t.param_dtypes.call_one().result(60)
        losses = [(await t.sft_step.call_one(SEQS, MASKS).result(120))["loss"] for _ in range(5)]
        await stop(procs, t)
        return info, dtypes, losses

    info, dtypes, losses = run(main(), 380)
    assert info["params_dtype"] == "bfloat16" and info["master_dtype"] == "float32", info
    names = list(dtypes)
    assert any(".in_proj_qkv." in n for n in names) and any(".self_attention.q_proj." in n for n in names)
    assert {d for d in dtypes.values()} == {"bfloat16"}, {n: d for n, d in dtypes.items() if d != "bfloat16"}
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] * 0.9, losses


def test_hybrid_tp2_shards_the_heads_and_serves_tp1s_logprobs_and_export():
    """Tensor parallel 2 over the hybrid layers (each rank its share of the Gated DeltaNet and
    gated-attention heads, the MoE as Megatron shards it): the export is the checkpoint bit
    for bit (sharded and gathered back), log-probs equal TP=1's; training with TP 2 is refused
    as for every mixture-of-experts model (it needs Megatron's sequence parallelism)."""
    import tempfile

    from engines.trainer.actor import MOE_TP_TRAINING
    from relay import ActorError

    path = make_model("qwen3_5_moe", "tiny", tempfile.mkdtemp(prefix="hybrid-tp-") + "/m", seed=3)

    async def one(tp):
        procs, t = await start(path, tp, tp=tp, optimizer="torch")
        exported = merged((await t.export_hf.call(4096).result(120)).values()[0])
        logprobs = (await t.compute_logprobs.call(SEQS[:3]).result(120)).values()
        local = (await t.local_weights.call("self_attention").result(120)).values()[0]
        shapes = {n: tuple(w.shape) for n, w in local.items()}
        refused = None
        if tp > 1:
            with pytest.raises(ActorError) as e:
                await t.train_step.call(TrainBatch(SEQS[:3], MASKS[:3], ADV[:3])).result(120)
            refused = str(e.value)
        await stop(procs, t)
        return exported, logprobs, shapes, refused

    async def main():
        return await one(1), await one(2)

    (e1, lp1, s1, _), (e2, lp2, s2, refused) = run(main(), 390)
    ckpt = {name: t for _, name, t in checkpoint_tensors(path) if not name.startswith(NOT_TRAINED)}
    for exported in (e1, e2):
        assert sorted(exported) == sorted(ckpt) and all(torch.equal(exported[n], ckpt[n]) for n in ckpt)
    for rank_lp in lp2:  # both TP ranks hold the full per-token log-probs
        assert max(abs(x - y) for r1, r2 in zip(lp1[0], rank_lp) for x, y in zip(r1, r2)) < 1e-5
    qkv = [n for n in s1 if n.endswith("in_proj_qkv.weight")]
    q = [n for n in s1 if n.endswith("self_attention.q_proj.weight")]
    assert qkv and q
    for n in qkv + q:  # each rank holds half the heads
        assert s2[n][0] * 2 == s1[n][0], (n, s1[n], s2[n])
    assert MOE_TP_TRAINING[:60] in refused
