"""Vocab-parallel log-probs at TP=2 equal TP=1; a GRPO step moves log-probs the right way."""

from __future__ import annotations

import pytest

from engines.model_builder import make_model
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
