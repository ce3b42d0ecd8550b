"""The dapo rule-based grader (extraction, grade) and the lenient equivalence helpers
(normalize, is_equiv) the judge drift audit uses. grade() is checked case by case against
the DAPO reference in test_dapo_reference.py."""

from __future__ import annotations

import pytest

from reward.math_grader import extract_answer, grade, is_equiv, last_boxed, normalize

pytestmark = pytest.mark.unit

EQUIVALENT = [
    ("5", "5"),
    ("-3", "-3"),
    ("  42 ", "42"),
    ("1,000", "1000"),
    ("12,345,678", "12345678"),
    ("0.5", "1/2"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{4}", "3/4"),
    ("\\tfrac{3}{4}", "\\frac{3}{4}"),
    ("\\frac12", "1/2"),
    ("-\\frac{2}{3}", "-2/3"),
    ("\\frac{-2}{3}", "-2/3"),
    ("2.50", "2.5"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("45°", "45"),
    ("30\\%", "30"),
    ("30%", "30"),
    ("\\$18", "18"),
    ("$18$", "18"),
    ("\\text{5 cm}", "5"),
    ("12 inches", "12"),
    ("7 dollars", "7"),
    ("x = 3", "3"),
    ("y=-4", "-4"),
    ("\\left(2, 3\\right)", "(2,3)"),
    ("\\sqrt{2}", "\\sqrt{2}"),
    ("\\pi", "\\pi"),
    ("\\mathrm{ABC}", "ABC"),
    ("100.", "100"),
    ("0.25", "\\frac{1}{4}"),
    ("3/6", "1/2"),
    ("-0.75", "-\\frac{3}{4}"),
    ("10^{\\circ}", "10"),
    ("\\textbf{8}", "8"),
]

DIFFERENT = [
    ("5", "6"),
    ("-3", "3"),
    ("\\frac{1}{3}", "0.33"),
    ("1/2", "2"),
    ("12", "1,2"),
    ("\\sqrt{2}", "\\sqrt{3}"),
    ("x", "y"),
    ("100", "1000"),
]


@pytest.mark.parametrize("pred,label", EQUIVALENT)
def test_equivalent_answers(pred, label):
    assert is_equiv(pred, label), (normalize(pred), normalize(label))


@pytest.mark.parametrize("pred,label", DIFFERENT)
def test_different_answers(pred, label):
    assert not is_equiv(pred, label)


def test_extraction():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("nested \\boxed{\\text{{a}}b}") == "\\text{{a}}b"
    assert last_boxed("\\boxed 7 done") == "7"
    assert last_boxed("no box") is None
    assert extract_answer("work...\nAnswer: 12\nextra") == "12"
    assert extract_answer("Answer: 3\nAnswer: 4") == "4"
    # as in the DAPO reference: the Answer: line is the answer, a \boxed{} alone is not
    assert extract_answer("Answer: 1 \\boxed{2}") == "1 \\boxed{2}"
    assert extract_answer("\\boxed{2}") is None
    assert extract_answer("answer : 5") == "5"
    assert extract_answer("nothing here") is None


def test_grade_scores():
    # as in the DAPO reference: no Answer: line is wrong (pred "[INVALID]"), and answers are
    # compared as normalized strings, so 1/2 and 0.5 differ
    assert grade("so the result is \\boxed{\\dfrac{1}{2}}", "0.5") == {"score": -1.0, "acc": False,
                                                                       "pred": "[INVALID]"}
    assert grade("Answer: \\boxed{\\frac{1}{2}}", "\\frac12") == {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}
    assert grade("Answer: \\frac{1}{2}", "0.5")["acc"] is False
    assert grade("Answer: 7", "8")["score"] == -1.0
    assert grade("I don't know", "8") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert grade("Answer: 1,024", 1024)["acc"]
