"""The demo's judge data: a policy trained against the judge looks for answers the judge
wrongly accepts, so the judge is taught on every kind of output the tiny policy can make."""

from __future__ import annotations

import json
import os

import pytest

from launcher.demo_task import JUNK, RESTATED_CHARS, judge_response, write_demo_data

pytestmark = pytest.mark.unit


def test_the_judge_learns_to_reject_every_junk_character(tmp_path):
    paths = write_demo_data(str(tmp_path))
    with open(paths["judge_sft"]) as f:
        rows = [json.loads(line) for line in f]
    answers: dict[str, set[str]] = {}
    for r in rows:
        text = r["prompt"][-1]["content"]
        answer = text.split("Answer: ", 1)[1].split("\n", 1)[0]
        label = text.rsplit("Reference: ", 1)[1]
        assert r["response"] == judge_response(answer, label)
        assert r["response"].endswith(" 1") == (answer == label)
        answers.setdefault(answer, set()).add(r["response"][-1])
    for c in JUNK:  # each non-digit character a policy can emit is a wrong answer the judge has seen
        assert answers.get(c) == {"0"}, c
    assert answers.get("") == {"0"}
    sentences = [a for a in answers if " " in a and len(a) > RESTATED_CHARS]
    assert len(sentences) > 500 and max(map(len, sentences)) == 64  # sentences too, all of them wrong
    assert all(answers[a] == {"0"} for a in sentences)
    assert sum(1 for r in rows if r["response"].endswith(" 1")) / len(rows) > 0.3  # matches stay common
    assert os.path.getsize(paths["judge_sft_eval"]) > 0


def test_a_missed_bar_says_when_the_policy_learned_to_fool_the_judge():
    """A judge that says 1 to some wrong answers can be gamed: the demo's message then says so
    (a run of 2026-12-05: exact 0.315 -> 0.09 while the judge's accuracy rose to 0.335)."""
    from launcher.demo import shortfall

    fooled = shortfall(0.315, 0.09, 0.335, "/r")
    assert fooled.startswith("relay demo: the held-out accuracy rose by -22.5 points, less than the 10 the demo")
    assert "the judge accepted 0.335 of the held-out answers but 0.090 are right" in fooled
    assert "/r/judge_audit.jsonl" in fooled and "--sft-steps" in fooled
    honest = shortfall(0.30, 0.35, 0.36, "/r")  # too little learning, and the judge agrees with the grader
    assert "rose by 5.0 points" in honest and "judge accepted" not in honest
