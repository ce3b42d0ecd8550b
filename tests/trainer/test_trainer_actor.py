"""TrainerActor on CPU/gloo: offload/onload exactness, checkpoint resume, and weight export
into a built-in engine (the engine then reproduces the trainer's log-probs)."""

from __future__ import annotations

import math

import pytest
import torch

from engines.builtin import TorchEngine
from engines.models.model_builder import make_model
from engines.trainer.actor import TrainerActor
from engines.trainer.train_batch import TrainBatch
from relay import ActorError, setup_torch_distributed, this_host
from tests.helpers import run, start_trainer, stop_trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEQS = [[5 + (i * 11 + j * 5) % 90 for j in range(18)] for i in range(4)]
MASKS = [[0] * 5 + [1] * 12 for _ in SEQS]  # tokens 1..17: prompt 6 tokens, response 12
ADV = [1.0, -1.0, 0.5, -0.5]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("p") / "policy"), seed=6)


async def start(policy, gpus: int = 1, **kw):
    return await start_trainer(TrainerActor, policy, gpus, lr=1e-2, **kw)


async def each_rank(t, method: str, per_rank: list) -> list:
    """Call ``method`` on DP rank r with ``per_rank[r]`` (its own shard of the batch)."""
    import asyncio

    calls = [getattr(t.slice(gpus=r), method).call_one(*args).result(120) for r, args in enumerate(per_rank)]
    return list(await asyncio.gather(*calls))


def dp2_batches():
    """Two DP ranks, different data on each (so the gradients really are averaged)."""
    return [(TrainBatch(SEQS[:2], MASKS[:2], ADV[:2]),), (TrainBatch(SEQS[2:], MASKS[2:], ADV[2:]),)]


stop = stop_trainer


def test_offload_onload_is_exact(policy):
    async def main():
        procs, a = await start(policy)
        await a.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        moved = await a.offload.call_one()
        with pytest.raises(Exception, match="offloaded"):
            await a.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        await a.onload.call_one()
        s_a = await a.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        lp_a = await a.compute_logprobs.call_one(SEQS)
        await stop(procs, a)
        procs, b = await start(policy)
        await b.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        s_b = await b.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        lp_b = await b.compute_logprobs.call_one(SEQS)
        await stop(procs, b)
        return moved, s_a, s_b, lp_a, lp_b

    moved, s_a, s_b, lp_a, lp_b = run(main(), 280)
    assert moved > 0
    assert s_a["loss"] == s_b["loss"] and s_a["grad_norm"] == s_b["grad_norm"]
    assert lp_a == lp_b  # bit-identical


def test_checkpoint_resume_reproduces_the_next_loss(policy, tmp_path):
    ckpt = str(tmp_path / "ckpt")

    async def main():
        procs, a = await start(policy)
        await a.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        await a.save_checkpoint.call_one(ckpt)
        next_a = await a.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        await stop(procs, a)
        procs, b = await start(policy)
        step = await b.load_checkpoint.call_one(ckpt)
        next_b = await b.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        await stop(procs, b)
        return step, next_a, next_b

    step, next_a, next_b = run(main(), 280)
    assert step == 1 and next_a["loss"] == next_b["loss"]


def test_exported_weights_make_the_engine_match_the_trainer(policy):
    async def main():
        procs, t = await start(policy)
        await t.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)  # weights now differ from the checkpoint
        buckets = await t.export_hf.call_one(4096)  # small buckets: several of them
        eng = TorchEngine(policy, kv_cache_tokens=2048, weights_mode="discard")
        await eng.sleep(["weights"])
        await eng.wake(["weights"])
        await eng.update_weights(buckets, version=1)
        r = await eng.generate(SEQS[0][:6], {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
        seq = SEQS[0][:6] + r.token_ids
        trainer_lp = (await t.compute_logprobs.call_one([seq]))[0][5:]
        await eng.close()
        await stop(procs, t)
        return buckets, r, trainer_lp

    buckets, r, trainer_lp = run(main(), 280)
    assert len(buckets) > 1
    assert max(abs(a - b) for a, b in zip(r.logprobs, trainer_lp)) < 1e-4
    assert r.weight_version == 1


def test_sft_steps_lower_the_loss_on_the_response_tokens(policy):
    async def main():
        procs, t = await start(policy)
        losses = [(await t.sft_step.call_one(SEQS, MASKS).result(120))["loss"] for _ in range(5)]
        await stop(procs, t)
        return losses

    losses = run(main(), 280)
    assert losses[-1] < losses[0] * 0.9, losses


def test_micro_batching_matches_one_pass(policy):
    """Gradients accumulated over micro-batches (each weighted by its share of the response
    tokens) give the same step as one pass over the whole batch."""
    seqs = SEQS + [s[:12] for s in SEQS]  # mixed lengths
    masks = MASKS + [[0] * 5 + [1] * 6 for _ in SEQS]
    adv = ADV + [-a for a in ADV]

    async def main():
        out = []
        for budget in (8192, 40):  # one pass / micro-batches of at most 40 padded tokens
            procs, t = await start(policy, micro_batch_tokens=budget)
            st = await t.train_step.call_one(TrainBatch(seqs, masks, adv)).result(120)
            sft = await t.sft_step.call_one(seqs, masks).result(120)
            lp = await t.compute_logprobs.call_one(seqs)
            out.append((st, sft, lp))
            await stop(procs, t)
        return out

    (a, sa, lpa), (b, sb, lpb) = run(main(), 280)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert sb["loss"] == pytest.approx(sa["loss"], rel=1e-5)
    assert max(abs(x - y) for ra, rb in zip(lpa, lpb) for x, y in zip(ra, rb)) < 1e-4


def test_dp2_distributed_optimizer_offload_onload_is_exact(policy):
    """DP = 2 with Megatron's distributed optimizer (sharded fp32 state, reduce-scatter and
    all-gather over gloo): an offload/onload cycle between steps changes nothing."""

    async def main():
        out = []
        for cycle in (True, False):
            procs, t = await start(policy, gpus=2)
            kinds = (await t.optimizer_info.call().result(60)).values()
            await each_rank(t, "train_step", dp2_batches())
            moved = 0
            if cycle:
                moved = sum((await t.offload.call().result(60)).values())
                await t.onload.call().result(60)
            stats = await each_rank(t, "train_step", dp2_batches())
            lp = (await t.compute_logprobs.call(SEQS).result(60)).values()
            await stop(procs, t)
            out.append((kinds, moved, stats, lp))
        return out

    (kinds, moved, s_a, lp_a), (_, _, s_b, lp_b) = run(main(), 280)
    assert all(k["kind"] == "megatron" and k["distributed"] and k["dp"] == 2 for k in kinds), kinds
    assert moved > 0
    assert s_a == s_b
    assert lp_a[0] == lp_a[1] == lp_b[0]  # replicas agree, bit-identical to no offload


def test_dp2_distributed_optimizer_matches_torch_adamw(policy):
    """The sharded optimizer computes the same update as the replicated torch AdamW path
    (both average the DP gradients; float rounding differs with the reduction order)."""

    async def main():
        out = []
        for opt in ("megatron", "torch"):
            procs, t = await start(policy, gpus=2, optimizer=opt)
            for _ in range(2):
                stats = await each_rank(t, "train_step", dp2_batches())
            lp = (await t.compute_logprobs.call(SEQS).result(60)).values()[0]
            await stop(procs, t)
            out.append((stats, lp))
        return out

    (s_m, lp_m), (s_t, lp_t) = run(main(), 280)
    assert s_m[0]["grad_norm"] == pytest.approx(s_t[0]["grad_norm"], rel=1e-4)
    assert max(abs(a - b) for ra, rb in zip(lp_m, lp_t) for a, b in zip(ra, rb)) < 1e-4


def test_dp2_distributed_optimizer_checkpoint_resume_is_exact(policy, tmp_path):
    ckpt = str(tmp_path / "ckpt")

    async def main():
        procs, a = await start(policy, gpus=2)
        await each_rank(a, "train_step", dp2_batches())
        await a.save_checkpoint.call(ckpt).result(60)
        next_a = await each_rank(a, "train_step", dp2_batches())
        lp_a = (await a.compute_logprobs.call(SEQS).result(60)).values()[0]
        await stop(procs, a)
        procs, b = await start(policy, gpus=2)
        steps = (await b.load_checkpoint.call(ckpt).result(60)).values()
        next_b = await each_rank(b, "train_step", dp2_batches())
        lp_b = (await b.compute_logprobs.call(SEQS).result(60)).values()[0]
        await stop(procs, b)
        return steps, next_a, next_b, lp_a, lp_b

    steps, next_a, next_b, lp_a, lp_b = run(main(), 280)
    assert list(steps) == [1, 1]
    assert next_a == next_b and lp_a == lp_b


def test_bf16_params_train_with_fp32_master_weights(policy):
    """--bf16: the model's params are bf16, the (Megatron) optimizer updates fp32 master
    weights; SFT steps lower the loss, and an offload/onload cycle keeps the params. No
    micro-batch size given on CPU: 8,192 tokens (engines/trainer/memory.py)."""

    async def main():
        procs, t = await start(policy, bf16=True)
        info = await t.optimizer_info.call_one().result(60)
        losses = [(await t.sft_step.call_one(SEQS, MASKS).result(120))["loss"] for _ in range(5)]
        lp = await t.compute_logprobs.call_one(SEQS).result(60)
        await t.offload.call_one().result(60)
        await t.onload.call_one().result(60)
        lp_after = await t.compute_logprobs.call_one(SEQS).result(60)
        await stop(procs, t)
        return info, losses, lp, lp_after

    info, losses, lp, lp_after = run(main(), 280)
    assert info["kind"] == "megatron" and info["params_dtype"] == "bfloat16" and info["master_dtype"] == "float32", info
    assert info["micro_batch_tokens"] == 8192, info
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] * 0.9, losses
    assert lp == lp_after


def test_bf16_needs_the_megatron_optimizer(policy):
    with pytest.raises(ValueError, match="fp32 master weights"):
        TrainerActor(policy, bf16=True, optimizer="torch")


@pytest.mark.parametrize("opt", ["torch", "megatron"])
def test_tp2_training_matches_tp1(policy, opt):
    """Two TP shards (DP = 1) train like one: the first step's gradient norm is the whole
    model's (shards summed over TP, replicated norms once — the torch path used to report
    and clip by each shard's own norm), and two steps move the log-probs as at TP = 1 (up
    to rounding that Adam amplifies on near-zero gradients)."""

    async def main():
        out = []
        for gpus, tp, kind in ((1, 1, "torch"), (2, 2, opt)):
            procs, t = await start(policy, gpus=gpus, tp=tp, optimizer=kind)
            kinds = (await t.optimizer_info.call().result(60)).values()
            before = (await t.compute_logprobs.call(SEQS).result(60)).values()[0]
            stats = [(await t.train_step.call(TrainBatch(SEQS, MASKS, ADV)).result(120)).values() for _ in range(2)]
            lp = (await t.compute_logprobs.call(SEQS).result(60)).values()
            await stop(procs, t)
            out.append((kinds, stats, before, lp))
        return out

    (_, s1, before1, lp1), (kinds, s2, before2, lp2) = run(main(), 280)
    assert all(k["kind"] == opt for k in kinds), kinds
    assert s2[0][0]["grad_norm"] == s2[0][1]["grad_norm"] == pytest.approx(s1[0][0]["grad_norm"], rel=1e-5)
    assert lp2[0] == lp2[1]  # both TP ranks return the same (gathered) log-probs
    d1 = [a - b for ra, rb in zip(lp1[0], before1) for a, b in zip(ra, rb)]
    d2 = [a - b for ra, rb in zip(lp2[0], before2) for a, b in zip(ra, rb)]
    err = math.sqrt(sum((a - b) ** 2 for a, b in zip(d1, d2))) / math.sqrt(sum(a * a for a in d1))
    assert err < 0.05


def _samples() -> list:
    from launcher.rl.sample import Sample

    return [Sample(index=i, dataset="train", group_index=i // 2, prompt="p", label="l", metadata={},
                   prompt_ids=s[:6], response_ids=s[6:], response="r", rollout_logprobs=[-1.0] * 12,
                   finish_reason="length", weight_version=0) for i, s in enumerate(SEQS)]


@pytest.mark.parametrize("global_batch", [4, 2])
def test_ppo_ratio_is_against_the_policy_before_the_rollouts_first_step(policy, global_batch):
    """GRPO over a rollout in one optimizer step: the old log-probs are the step's own
    (``ppo_kl`` exactly 0). In two steps (``--global-batch-size`` half the rollout): the
    second step's old log-probs are the policy's before the first step, so its ratio is not 1
    (``ppo_kl`` averaged over the steps is not 0)."""
    from launcher.rl.trainer_group import TrainerGroup

    async def main():
        procs = this_host().spawn_procs(per_host={"ranks": 1})  # the launcher's trainer mesh dimension
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, policy, lr=1e-2, loss={"eps_clip": 0.2})
        await t.initialized(240)
        try:
            batch = TrainBatch([s.prompt_ids + s.response_ids for s in _samples()], MASKS, ADV,
                               rollout_logprobs=[[0.0] * 5 + s.rollout_logprobs for s in _samples()])
            return await TrainerGroup(t, 1, 1).train_rl(batch, global_batch)
        finally:
            await stop(procs, t)

    stats = run(main(), 280)
    if global_batch == 4:
        assert stats["ppo_kl"] == 0.0 and stats["pg_clipfrac"] == 0.0
    else:
        assert stats["ppo_kl"] != 0.0  # 0 for the first step, the second's old policy is the first's


def test_a_cpu_rank_runs_one_intra_op_thread_unless_asked_or_told(monkeypatch):
    """relay train's CPU ranks share the cores with the engines (1 thread); relay sft asks for
    cores // ranks; RELAY_TRAINER_CPU_THREADS overrides both."""
    from engines.trainer.actor import _cpu_threads

    monkeypatch.delenv("RELAY_TRAINER_CPU_THREADS", raising=False)
    assert (_cpu_threads(None), _cpu_threads(2)) == (1, 2)
    monkeypatch.setenv("RELAY_TRAINER_CPU_THREADS", "3")
    assert (_cpu_threads(None), _cpu_threads(2)) == (3, 3)


@pytest.mark.parametrize("optimizer,gpus", [("torch", 1), ("megatron", 2)])
def test_a_non_finite_gradient_raises_on_every_rank_before_any_weight_changes(policy, optimizer, gpus):
    """A NaN reaching the loss (here one rollout log-prob under TIS, on one DP rank's shard)
    stops the step on every rank with FloatingPointError; the weights are unchanged and the
    next clean step trains (both optimizer paths: Megatron's checks only under a loss scaler)."""
    import asyncio

    rollout = [[0.0] * 5 + [-1.0] * 12 for _ in SEQS]
    rollout[1][8] = math.nan

    async def main():
        procs, t = await start(policy, gpus=gpus, optimizer=optimizer, loss={"use_tis": True})
        try:
            before = (await t.compute_logprobs.call(SEQS).result(60)).values()
            shards = TrainBatch(SEQS, MASKS, ADV, rollout_logprobs=rollout).shard(gpus)
            errors = await asyncio.gather(*(t.slice(gpus=r).train_step.call_one(s).result(120)
                                            for r, s in enumerate(shards)), return_exceptions=True)
            after = (await t.compute_logprobs.call(SEQS).result(60)).values()
            clean = TrainBatch(SEQS, MASKS, ADV, rollout_logprobs=[[0.0] * 5 + [-1.0] * 12 for _ in SEQS]).shard(gpus)
            stats = await asyncio.gather(*(t.slice(gpus=r).train_step.call_one(s).result(120)
                                           for r, s in enumerate(clean)))
            return errors, before, after, stats
        finally:
            await stop(procs, t)

    errors, before, after, stats = run(main(), 280)
    assert all(isinstance(e, ActorError) and "FloatingPointError" in str(e) and "no weight changed" in str(e)
               for e in errors), errors
    assert after == before
    assert all(math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 for s in stats)


@pytest.mark.parametrize("optimizer,gpus", [("torch", 1), ("megatron", 2)])
def test_clip_grad_bounds_the_update_on_both_optimizer_paths(policy, optimizer, gpus):
    """--clip-grad scales the whole gradient to that norm before the update: clipped to 1e-9
    (far under Adam's eps) one step at lr 1e-2 leaves the log-probs almost where they were,
    while the unclipped step moves them; both report the norm before clipping."""
    import asyncio

    async def one_step(clip_grad: float):
        procs, t = await start(policy, gpus=gpus, optimizer=optimizer, clip_grad=clip_grad)
        try:
            before = (await t.compute_logprobs.call(SEQS).result(60)).values()[0]
            shards = TrainBatch(SEQS, MASKS, ADV).shard(gpus)
            stats = await asyncio.gather(*(t.slice(gpus=r).train_step.call_one(s).result(120)
                                           for r, s in enumerate(shards)))
            after = (await t.compute_logprobs.call(SEQS).result(60)).values()[0]
        finally:
            await stop(procs, t)
        moved = max(abs(a - b) for ra, rb in zip(before, after) for a, b in zip(ra, rb))
        return moved, stats[0]["grad_norm"]

    async def main():
        return [await one_step(0.0), await one_step(1e-9)]

    (free, norm_free), (clipped, norm_clipped) = run(main(), 280)
    assert free > 1e-2, free
    assert clipped < 0.02 * free, (clipped, free)
    assert norm_clipped == pytest.approx(norm_free, rel=1e-4) and norm_free > 1e-3


@pytest.mark.parametrize("optimizer,gpus", [("torch", 1), ("megatron", 2)])
def test_weight_decay_spares_norms_and_biases_on_both_optimizer_paths(policy, optimizer, gpus):
    """Megatron's rule (and the original's): 1-D weights and biases get no weight decay. With
    zero advantages the gradient is 0, so one step only decays: matrices shrink by lr x wd,
    norms stay."""
    lr, wd = 1e-2, 0.5
    zero = TrainBatch(SEQS, MASKS, [0.0] * len(SEQS))

    async def main():
        procs, t = await start(policy, gpus=gpus, optimizer=optimizer, weight_decay=wd)
        try:
            before = merged_export((await t.export_hf.call(1 << 30).result(120)).values()[0])
            await each_rank(t, "train_step", [(s,) for s in zero.shard(gpus)])
            after = merged_export((await t.export_hf.call(1 << 30).result(120)).values()[0])
            return before, after
        finally:
            await stop(procs, t)

    before, after = run(main(), 280)
    norms = [n for n in before if before[n].ndim == 1]
    matrices = [n for n in before if before[n].ndim == 2]
    assert norms and matrices
    assert all(torch.equal(after[n], before[n]) for n in norms), [n for n in norms if not torch.equal(after[n],
                                                                                                    before[n])]
    for n in matrices:
        assert torch.allclose(after[n], before[n] * (1 - lr * wd), rtol=1e-5, atol=1e-7), n


def merged_export(buckets: list) -> dict:
    return {n: t for bucket in buckets for n, t in bucket.items()}


def test_sft_and_greedy_match_name_a_response_mask_of_the_wrong_length(policy):
    """A response mask covers tokens 1..n of its sequence (len - 1 entries): one of len
    entries is refused with the sequence and both lengths named, before any weight changes."""

    async def main():
        procs, t = await start(policy)
        try:
            before = await t.compute_logprobs.call_one(SEQS[:1]).result(120)
            errors = []
            for endpoint in ("sft_step", "greedy_match"):
                with pytest.raises(ActorError) as err:
                    await getattr(t, endpoint).call_one(SEQS[:2], [MASKS[0], MASKS[1] + [1]]).result(120)
                errors.append(str(err.value))
            after = await t.compute_logprobs.call_one(SEQS[:1]).result(120)
        finally:
            await stop(procs, t)
        return errors, before, after

    errors, before, after = run(main(), 240)
    for e in errors:
        assert "sequence 1: its response mask covers 18 tokens, not tokens 1..n (17)" in e, e
    assert before == after
