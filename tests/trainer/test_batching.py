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
