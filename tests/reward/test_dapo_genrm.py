"""dapo-genrm: answer extraction, the judge prompt, strict and loose parsing, failures."""

from __future__ import annotations

import asyncio

import pytest

from reward.dapo_genrm import final_answer, judge_messages, parse_verdict, score

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "reply,strict,loose",
    [
        ("1", 1, 1),
        ("0", 0, 0),
        (" 1\n", 1, 1),
        ("1.", None, None),
        ("The answer is 1", None, 1),
        ("<think>maybe 0</think>1", None, 1),
        ("<think>1 or 0, say 1</think>\n0", None, 0),
        ("Judgement: 0", None, 0),
        ("yes", None, None),
        ("10", None, None),
        ("1 0 1", None, 1),
        ("", None, None),
        ("<think>only thinking 1</think>", None, None),
    ],
)
def test_parse_strict_and_loose(reply, strict, loose):
    assert parse_verdict(reply, "strict") == strict
    assert parse_verdict(reply, "loose") == loose


def test_final_answer_and_prompt():
    assert final_answer("work\nAnswer: 42") == "42"
    assert final_answer("Answer: 1\nmore\nAnswer: 2 ") == "2"
    long = "x" * 500 + "the end"
    assert final_answer(long) == long[-300:]
    msgs = judge_messages("What is 6*7?", "42", "so Answer: 42")
    assert (
        msgs[0]["role"] == "user"
        and "What is 6*7?" in msgs[0]["content"]
        and "Model's final answer:\n42" in msgs[0]["content"]
    )
    with pytest.raises(ValueError):
        parse_verdict("1", "fuzzy")


def test_score_with_a_judge_and_with_failures():
    seen = []

    async def judge(messages):
        seen.append(messages)
        return "1" if "42" in messages[0]["content"].split("Model's final answer:")[1] else "0"

    async def broken(messages):
        raise ConnectionError("judge down")

    async def chatty(messages):
        return "I think they match: 1"

    sample = {"prompt": [{"role": "user", "content": "6*7?"}], "label": "42", "response": "Answer: 42"}
    good = asyncio.run(score(sample, judge))
    bad = asyncio.run(score({**sample, "response": "Answer: 41"}, judge))
    failed = asyncio.run(score(sample, broken))
    strict = asyncio.run(score(sample, chatty))
    loose = asyncio.run(score(sample, chatty, parse="loose"))
    assert good == {"score": 1.0, "acc": True, "pred": "42", "judge_response": "1", "format_error": ""}
    assert bad["score"] == 0.0 and not bad["acc"]
    assert failed["score"] == 0.0 and failed["format_error"] == "judge_error"
    assert strict["score"] == 0.0 and strict["format_error"] == "parse_error"
    assert loose["score"] == 1.0
    assert "6*7?" in seen[0][0]["content"]  # question taken from the chat prompt
