"""Micro-batch grouping (engines/trainer/batching.py): short rows are not padded to a few
long ones, the token budget holds, and every sequence is in exactly one group."""

from __future__ import annotations

import random

import pytest

from engines.trainer.batching import micro_batches

pytestmark = pytest.mark.unit


def padded(seqs: list, groups: list) -> int:
    return sum(len(g) * max(len(seqs[i]) for i in g) for g in groups)


def test_a_few_long_rows_get_a_micro_batch_of_their_own():
    seqs = [[0] * 50] * 60 + [[0] * 120] * 4  # the demo judge's data: some sentences among short answers
    groups = micro_batches(seqs, 8192)
    assert groups == [list(range(60)), [60, 61, 62, 63]]
    assert padded(seqs, groups) == 60 * 50 + 4 * 120  # not 64 x 120


@pytest.mark.parametrize("seed", range(20))
def test_groups_cover_every_sequence_once_within_the_budget(seed):
    rng = random.Random(seed)
    seqs = [[0] * rng.randint(1, 90) for _ in range(rng.randint(1, 80))]
    budget = rng.choice([40, 300, 8192])
    groups = micro_batches(seqs, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(seqs)))
    for g in groups:  # over budget only as a lone sequence longer than the budget
        assert len(g) * max(len(seqs[i]) for i in g) <= budget or len(g) == 1
    assert padded(seqs, groups) <= padded(seqs, [list(range(len(seqs)))])  # never more padding than one group


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_padded_rows_and_aligned_values_are_what_row_by_row_tensors_give(dtype):
    """The trainer's inputs (token ids, response masks) and given log-probs, built in one
    piece: each row's values first (rounded to the dtype as ``torch.tensor`` rounds them),
    zeros (``padded``) or the base's own values (``aligned``) after; a row wider than the
    batch is an error."""
    import torch

    from engines.trainer.batching import aligned
    from engines.trainer.batching import padded as pad_rows

    rng = random.Random(3)
    dt = getattr(torch, dtype)
    rows = [[rng.uniform(-20, 0) * rng.choice([1e-3, 1, 1e3]) for _ in range(rng.randint(0, 12))] for _ in range(9)]
    base = torch.randn(9, 12).to(dt)
    expect = base.clone()
    for i, r in enumerate(rows):
        expect[i, : len(r)] = torch.tensor(r, dtype=dt)
    got = aligned(base, rows)
    assert got.dtype == dt and torch.equal(got, expect)
    ids = [[rng.randint(0, 1 << 40) for _ in range(rng.randint(1, 12))] for _ in range(9)]
    want = torch.zeros(9, 12, dtype=torch.long)
    for i, r in enumerate(ids):
        want[i, : len(r)] = torch.tensor(r)
    assert torch.equal(pad_rows(ids, 12), want) and pad_rows(ids, 12).dtype == torch.int64
    zeros = torch.zeros(9, 12, dtype=dt)
    for i, r in enumerate(rows):
        zeros[i, : len(r)] = torch.tensor(r, dtype=dt)
    assert torch.equal(pad_rows(rows, 12, dt), zeros)
    with pytest.raises(ValueError):
        pad_rows([[1, 2, 3]], 2)
