"""The trainer's boundary: TrainBatch's checks, its optimizer steps and DP shards (each with the
whole step's denominator), StepStats' combination over DP ranks, and both on relay's wire."""

from __future__ import annotations

import math

import pytest

from engines.trainer.train_batch import StepStats, TrainBatch
from relay._wire import decode, encode

pytestmark = pytest.mark.unit


def batch(n: int = 5, **kw) -> TrainBatch:
    tokens = [[1] * (3 + i) for i in range(n)]  # uneven lengths
    masks = [[0, 0] + [1] * (len(t) - 3) for t in tokens]  # response tokens: i (sample 0 has none)
    return TrainBatch(tokens, masks, [float(i) for i in range(n)], **kw)


def test_shards_carry_the_whole_steps_denominator_and_cover_every_sample_once():
    for aggregation, total in (("sample", 5), ("token", 0 + 1 + 2 + 3 + 4)):
        b = batch(aggregation=aggregation)
        shards = b.shard(2)
        assert [s.denominator for s in shards] == [total, total]
        assert sorted(a for s in shards for a in s.advantages) == b.advantages
        assert shards[0].advantages == [0.0, 2.0, 4.0]  # round robin
    # fewer samples than ranks: every rank trains the whole batch, counted once per rank
    shards = batch(n=2).shard(4)
    assert len(shards) == 4 and all(len(s) == 2 and s.denominator == 2 * 4 for s in shards)


def test_optimizer_steps_are_consecutive_runs_each_a_whole_step():
    steps = batch(n=5, old_logprobs=[[0.0] * (2 + i) for i in range(5)]).optimizer_steps(2)
    assert [s.advantages for s in steps] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert all(s.denominator is None for s in steps)
    assert [len(s.old_logprobs) for s in steps] == [2, 2, 1]


@pytest.mark.parametrize("change,message", [
    (dict(aggregation="mean"), "aggregation must be one of"),
    (dict(temperature=0.0), "temperature must be a positive number"),
    (dict(temperature=math.nan), "temperature must be a positive number"),
    (dict(advantages=[0.0, math.nan, 0.0, 0.0, 0.0]), "sequence 1's advantage is nan"),
    (dict(advantages=[0.0]), "5 sequences, 5 response masks and 1 advantages"),
    (dict(rollout_logprobs=[[0.0]] * 4), "rollout_logprobs: 4 rows for 5 sequences"),
    (dict(response_masks=[[1]] * 5), "sequence 0: its response mask covers 1 tokens, not tokens 1..n"),
    (dict(ref_logprobs=[[0.0] * 9] * 5), "sequence 0: 9 ref_logprobs for 2 tokens"),
    (dict(denominator=0), "denominator must be positive"),
])
def test_a_malformed_batch_is_refused_naming_what_is_wrong(change, message):
    b = batch()
    for k, v in change.items():
        setattr(b, k, v)
    with pytest.raises(ValueError, match=message):
        b.validate()


def test_step_stats_add_shares_average_rank_figures_and_take_maxima():
    a = StepStats(2.0, 1e-3, {"loss": 0.25, "entropy": 1.0}, {"moe_load_balancing_loss": 1.0},
                  {"rollout_logprob_abs_diff_max": 0.1})
    b = StepStats(2.0, 1e-3, {"loss": 0.5, "entropy": 2.0}, {"moe_load_balancing_loss": 3.0},
                  {"rollout_logprob_abs_diff_max": 0.3})
    step = StepStats.combine([a, b])
    assert step.as_dict() == {"loss": 0.75, "entropy": 3.0, "moe_load_balancing_loss": 2.0,
                              "rollout_logprob_abs_diff_max": 0.3, "grad_norm": 2.0, "lr": 1e-3}
    assert step["loss"] == 0.75 and "entropy" in step and sorted(step) == sorted(step.keys())


def test_both_travel_on_relays_wire():
    b = batch(rollout_logprobs=[[0.5] * (2 + i) for i in range(5)], temperature=0.7, aggregation="token")
    s = StepStats(1.5, 1e-6, {"loss": 0.1}, {}, {"rollout_logprob_abs_diff_max": 0.0})
    for value in (b, s):
        header, buffers = encode(value)
        assert decode(header, buffers) == value
