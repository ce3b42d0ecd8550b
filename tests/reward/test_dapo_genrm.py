"""dapo-genrm: the documented prompt, extraction, strict verdict and return shape; the newer
``boxed`` variant (answer gating, loose verdict); loose parsing; judge failures."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from launcher.data import Row
from launcher.rl.sample import Sample
from reward.dapo_genrm import (
    BOXED_PROMPT_TEMPLATE,
    DAPO_GENRM_PROMPT_TEMPLATE,
    boxed_answer,
    check_template,
    extract_answer,
    final_answer,
    judge_messages,
    last_boxed,
    parse_verdict,
    score,
)

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


@pytest.mark.parametrize(
    "reply,verdict",
    [
        ("1", 1),
        ("0", 0),
        ("Judgement: 1", 1),
        ("they differ. Judgement: 0", 0),
        ("Judgement: 1 ... Judgement: 0", 0),  # the text after the LAST "Judgement:"
        ("Judgement:      1", 1),  # stripped first
        ("Judgement: the two are the same, 1", 0),  # "1" is past the first 16 characters
        ("1.", 1),
        ("yes", 0),
    ],
)
def test_boxed_parse_reads_the_first_16_characters_after_the_last_judgement(reply, verdict):
    assert parse_verdict(reply, "boxed") == verdict


def test_documented_extraction_is_exactly_split_or_the_last_300_characters():
    assert extract_answer("work\nAnswer: 42") == " 42"  # not stripped, as documented
    assert extract_answer("Answer: 1\nmore\nAnswer: 2 ") == " 2 "
    long = "x" * 500 + "the end"
    assert extract_answer(long) == long[-300:]
    assert final_answer("work\nAnswer: 42 ") == "42"
    with pytest.raises(ValueError):
        parse_verdict("1", "fuzzy")


def test_the_documented_template_and_messages():
    # the lines the documentation shows, verbatim
    assert DAPO_GENRM_PROMPT_TEMPLATE.startswith("Below are two answers to a question. ")
    assert DAPO_GENRM_PROMPT_TEMPLATE.endswith(
        "\n[Question]: {question}\n[Standard Answer]: {ground_truth}\n[Model_answer] : {predict_str}\nJudgement:"
    )
    msgs = judge_messages("What is 6*7?", "42", "so Answer: 42")
    assert len(msgs) == 1 and msgs[0]["role"] == "user"
    assert msgs[0]["content"] == DAPO_GENRM_PROMPT_TEMPLATE.format(
        question="What is 6*7?", ground_truth="42", predict_str=" 42"
    )
    tail = "[Question]: What is 6*7?\n[Standard Answer]: 42\n[Model_answer] :  42\nJudgement:"
    assert msgs[0]["content"].endswith(tail)
    # a custom template may use our names ({label}, {answer}: stripped) or the documented ones
    assert judge_messages("q", "7", "Answer: 7 ", "A={answer}|L={label}")[0]["content"] == "A=7|L=7"
    assert judge_messages("q", "7", "Answer: 7 ", "A={predict_str}|L={ground_truth}")[0]["content"] == "A= 7 |L=7"
    assert check_template("{predict_str} {ground_truth} {question}") and check_template("{answer}")
    for bad in ("{label} only", "{answer} {nope}", "{answer"):
        with pytest.raises(ValueError):
            check_template(bad)


def sample_of(response: str, label: str = "42", question: str = "What is 6*7?") -> Sample:
    result = SimpleNamespace(token_ids=[5], text=response, logprobs=[-0.1], finish_reason="stop", weight_version=0)
    return Sample.generated(Row(0, [{"role": "user", "content": question}], label), "train", 0, [1], result)


class Judge:
    """A judge that records the prompts it gets and answers ``reply(prompt)``."""

    def __init__(self, reply):
        self.reply, self.prompts = reply, []

    async def __call__(self, messages):
        self.prompts.append(messages[0]["content"])
        return self.reply(messages[0]["content"])


def test_documented_score_returns_score_acc_and_the_judges_reply_as_pred():
    judge = Judge(lambda p: "1" if p.endswith("[Model_answer] :  42\nJudgement:") else "0")
    good = asyncio.run(score(sample_of("work. Answer: 42"), judge))
    bad = asyncio.run(score(sample_of("work. Answer: 41"), judge))
    assert good["score"] == 1.0 and type(good["score"]) is float and good["acc"] == 1 and type(good["acc"]) is int
    assert good["pred"] == "1" and bad == {**bad, "score": 0.0, "acc": 0, "pred": "0"}
    assert good["format_error"] == "" and good["judge_response"] == "1"
    # the question and label come from metadata["question"] / metadata["label"] (Sample.generated sets them)
    assert "[Question]: What is 6*7?\n[Standard Answer]: 42\n" in judge.prompts[0]


@pytest.mark.parametrize("reply,expected", [("1", 1.0), (" 1\n", 1.0), ("1.", 0.0), ("Yes", 0.0), ("1\n0", 0.0)])
def test_documented_verdict_is_strict(reply, expected):
    out = asyncio.run(score(sample_of("Answer: 42"), Judge(lambda p: reply)))
    assert out["score"] == expected and out["acc"] == int(expected) and out["pred"] == reply.strip()


def test_metadata_wins_over_prompt_and_label_and_dicts_work_too():
    judge = Judge(lambda p: "1")
    s = {"prompt": "ignored?", "label": "x", "response": "Answer: 5", "metadata": {"question": "Q!", "label": "5"}}
    asyncio.run(score(s, judge))
    assert "[Question]: Q!\n[Standard Answer]: 5\n" in judge.prompts[0]
    asyncio.run(score({"prompt": [{"role": "user", "content": "from chat"}], "label": "9", "response": "9"}, judge))
    assert "[Question]: from chat\n[Standard Answer]: 9\n[Model_answer] : 9\n" in judge.prompts[1]


def test_judge_failures_and_loose_parse_keep_this_projects_contract():
    async def broken(messages):
        raise ConnectionError("judge down")

    failed = asyncio.run(score(sample_of("Answer: 42"), broken))
    assert failed["score"] == 0.0 and failed["acc"] == 0 and failed["format_error"] == "judge_error"
    chatty = Judge(lambda p: "I think they match: 1")
    strict = asyncio.run(score(sample_of("Answer: 42"), chatty))
    loose = asyncio.run(score(sample_of("Answer: 42"), chatty, parse="loose"))
    assert strict["score"] == 0.0 and strict["format_error"] == "parse_error"
    assert strict["pred"] == "I think they match: 1"
    assert loose["score"] == 1.0 and loose["format_error"] == ""
    with pytest.raises(ValueError, match="variant"):
        asyncio.run(score(sample_of("x"), chatty, variant="newest"))


def test_last_balanced_boxed():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{3} and an unclosed \\boxed{4") == "3"
    assert last_boxed("none") is None
    assert boxed_answer("so \\boxed{ 7 } Answer: 8") == "7"
    assert boxed_answer("work\nAnswer: 8\nmore text") == "8"  # else the last Answer: line
    assert boxed_answer("no answer here") == ""


def test_boxed_variant_gates_before_calling_the_judge_and_parses_loosely():
    judge = Judge(lambda p: "Judgement: 1" if "[Model_answer] : \\frac{1}{2}\nJudgement:" in p else "Judgement: 0")
    ok = asyncio.run(score(sample_of("\\boxed{\\frac{1}{2}}", label="0.5"), judge, variant="boxed"))
    wrong = asyncio.run(score(sample_of("\\boxed{3}", label="0.5"), judge, variant="boxed"))
    assert ok == {"score": 1.0, "acc": 1, "pred": "\\frac{1}{2}", "judge_response": "Judgement: 1", "format_error": ""}
    assert wrong["score"] == 0.0 and wrong["format_error"] == ""
    assert len(judge.prompts) == 2 and judge.prompts[0] == BOXED_PROMPT_TEMPLATE.format(
        question="What is 6*7?", ground_truth="0.5", predict_str="\\frac{1}{2}"
    )
    assert "[Standard Answer]: \\frac{1}{2}\n[Model_answer] : 0.5\nJudgement: 1\n" in judge.prompts[0]  # an example
    assert judge.prompts[0].count("[Question]:") == 6  # five in-context examples, then the question
    missing = asyncio.run(score(sample_of("I give up"), judge, variant="boxed"))
    too_long = asyncio.run(score(sample_of("\\boxed{" + "9" * 501 + "}"), judge, variant="boxed"))
    assert missing == {"score": 0.0, "acc": 0, "pred": "", "judge_response": "", "format_error": "answer_missing"}
    assert too_long["score"] == 0.0 and too_long["format_error"] == "answer_too_long"
    assert len(judge.prompts) == 2  # neither asked the judge
    fits = asyncio.run(score(sample_of("\\boxed{" + "9" * 500 + "}"), judge, variant="boxed"))
    assert fits["format_error"] == "" and len(judge.prompts) == 3
