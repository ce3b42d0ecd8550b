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
