"""``--rm-type dapo`` is the DAPO reference grader: our :func:`reward.math_grader.grade`
gives the verdict of verl's ``verl/utils/reward_score/math_dapo.py`` (slime's dapo rule) on
every case of tests/reward/data/dapo_reference_cases.jsonl. The expected verdicts were made
by running the reference out of tree; tests/reward/data/dapo_reference_cases.md names its
commit and holds the script that regenerates them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reward.math_grader import grade

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data" / "dapo_reference_cases.jsonl"


def load_cases() -> list[dict]:
    with open(DATA, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_corpus_is_broad():
    cases = load_cases()
    assert len(cases) >= 200
    assert all({"response", "label", "score", "acc", "pred"} <= set(c) for c in cases)
    correct = sum(c["acc"] for c in cases)
    assert 0 < correct < len(cases)  # both verdicts are exercised


def test_grade_matches_the_reference_on_every_case():
    mismatches = []
    for n, case in enumerate(load_cases(), 1):
        want = {"score": case["score"], "acc": case["acc"], "pred": case["pred"]}
        got = grade(case["response"], case["label"])
        if got != want:
            mismatches.append(f"line {n}: response={case['response'][-80:]!r} label={case['label']!r}: "
                              f"reference {want}, ours {got}")
    assert not mismatches, f"{len(mismatches)} case(s) differ from the reference:\n" + "\n".join(mismatches)


def test_label_may_be_a_number():
    # rewards.py passes str(label); grade() also takes the raw value
    assert grade("Answer: 1,024", 1024)["acc"] is True
