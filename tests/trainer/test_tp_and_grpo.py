"""Vocab-parallel log-probs at TP=2 equal TP=1; a GRPO step moves log-probs the right way."""

from __future__ import annotations

import pytest
import torch

from engines.models.model_builder import make_model
from engines.trainer.train_batch import TrainBatch
from relay import setup_torch_distributed, this_host
from tests.helpers import run
from tests.trainer.actors import TPTrainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEQS = [[5 + (i * 7 + j * 3) % 90 for j in range(20)] for i in range(3)]


async def trainer(path, tp):
    procs = this_host().spawn_procs(per_host={"gpus": tp})
    await setup_torch_distributed(procs)
    t = procs.spawn("trainer", TPTrainer)
    await t.setup_model.call(path, tp).result(240)
    return procs, t


def test_tp2_logprobs_equal_tp1_and_grpo_step_direction(tmp_path):
    path = make_model("qwen3", "tiny", str(tmp_path / "m"), seed=5)

    async def main():
        procs1, t1 = await trainer(path, 1)
        lp1 = await t1.logprobs.call_one(SEQS).result(120)
        before = lp1
        stats = await t1.grpo_step.call_one(SEQS[:2], [1.0, -1.0]).result(120)
        after = await t1.logprobs.call_one(SEQS).result(120)
        await t1.shutdown.call().result(60)
        await procs1.stop()
        procs2, t2 = await trainer(path, 2)
        lp2 = (await t2.logprobs.call(SEQS).result(120)).values()
        await t2.shutdown.call().result(60)
        await procs2.stop()
        return before, after, lp2, stats

    before, after, lp2, stats = run(main(), 280)
    for rank_lp in lp2:  # both TP ranks hold the full per-token log-probs
        assert max(abs(a - b) for ra, rb in zip(before, rank_lp) for a, b in zip(ra, rb)) < 1e-5
    seq_sum = lambda lp: [sum(r) for r in lp]  # noqa: E731
    b, a = seq_sum(before), seq_sum(after)
    assert a[0] > b[0] and a[1] < b[1]  # positive advantage up, negative down
    assert "pg_clipfrac" in stats and "ppo_kl" in stats


@pytest.mark.parametrize("opt", ["torch", "megatron"])
def test_tp2_qk_norm_gradients_are_the_whole_models(tmp_path, opt):
    """The q/k layernorm weights are shared by all heads while each TP rank normalises its own
    heads: their gradients are summed over TP (as Megatron's finalize_model_grads does), so
    they equal TP=1's and both ranks' copies stay equal after a step."""
    from tests.trainer.actors import GradTrainer

    path = make_model("qwen3", "tiny", str(tmp_path / "m"), seed=5)
    seqs, masks, adv = SEQS, [[0] * 4 + [1] * 15 for _ in SEQS], [1.0, -1.0, 0.5]

    async def main():
        out = []
        for tp in (1, 2):
            procs = this_host().spawn_procs(per_host={"gpus": tp})
            await setup_torch_distributed(procs)
            t = procs.spawn("trainer", GradTrainer, path, tp=tp, lr=1e-2, clip_grad=0.0, optimizer=opt)
            await t.initialized(240)
            await t.train_step.call(TrainBatch(seqs, masks, adv)).result(120)
            grads = (await t.full_grads.call().result(120)).values() if opt == "torch" else None
            weights = (await t.local_weights.call("layernorm").result(120)).values()
            await t.shutdown.call().result(60)
            await procs.stop()
            out.append((grads, weights))
        return out

    (g1, w1), (g2, w2) = run(main(), 280)
    names = [n for n in w2[0] if "q_layernorm" in n or "k_layernorm" in n]
    assert len(names) == 4
    for n in names:
        assert torch.equal(w2[0][n], w2[1][n]), f"{n}: the TP replicas drifted apart"
        assert (w2[0][n] - w1[0][n]).abs().max() < 1e-4, n
        if g1 is not None:
            assert (g2[0][n] - g1[0][n]).abs().max() < 1e-6, n
