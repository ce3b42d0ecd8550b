"""``--rm-type math-verify``: answers compared as mathematics by Math-Verify (the optional
``math-verify`` package), and the install hint when the package is missing."""

from __future__ import annotations

import asyncio
import sys

import pytest

from launcher.config import load_config
from reward import math_verify_grader
from reward.rewards import make_reward_fn

pytestmark = pytest.mark.unit
BASE = {"resource": {"actor": [1, 2], "rollout": [1, 2]}, "colocate": True}

# (response, label): the same answer written differently; the dapo reference grader says
# wrong to each (its comparison is of normalized strings)
EQUIVALENT = [
    ("The answer is $\\boxed{\\sqrt2/2}$.", "\\frac{\\sqrt2}{2}"),
    ("so \\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2"),
    ("The angle is \\boxed{\\pi/2}", "\\frac{\\pi}{2}"),
    ("\\boxed{\\dfrac{1}{2}}", "0.5"),
    ("The final answer is $0.5$", "\\frac12"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{x = 5}", "5"),
]
DIFFERENT = [
    ("\\boxed{3}", "4"),
    ("\\boxed{\\sqrt3/2}", "\\frac{\\sqrt2}{2}"),
    ("\\boxed{\\pi}", "\\frac{\\pi}{2}"),
    ("I don't know.", "4"),
    ("", "4"),
]


@pytest.mark.parametrize("response,label", EQUIVALENT)
def test_equivalent_answers_are_right(response, label):
    pytest.importorskip("math_verify")
    out = math_verify_grader.grade(response, label)
    assert out["score"] == 1.0 and out["acc"] is True and out["pred"], out


@pytest.mark.parametrize("response,label", DIFFERENT)
def test_different_or_missing_answers_are_wrong(response, label):
    pytest.importorskip("math_verify")
    out = math_verify_grader.grade(response, label)
    assert out["score"] == 0.0 and out["acc"] is False, out
    if not response.strip() or "know" in response:
        assert out["pred"] == ""


def test_the_rm_type_reaches_math_verify():
    pytest.importorskip("math_verify")
    fn = make_reward_fn(load_config(None, {**BASE, "rm_type": "math-verify"}))
    sample = {"prompt": "sin(45°)?", "label": "\\frac{\\sqrt2}{2}", "response": "So it is $\\boxed{\\sqrt2/2}$."}
    assert asyncio.run(fn(sample)) == {"score": 1.0, "acc": True, "pred": "\\sqrt{2}/2"}


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'relay-rl\[math-verify\]'"):
        math_verify_grader.grade("\\boxed{1}", "1")
    with pytest.raises(ImportError, match=r"--rm-type math-verify needs the math-verify package"):
        make_reward_fn(load_config(None, {**BASE, "rm_type": "math-verify"}))
