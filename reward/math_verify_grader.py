"""``--rm-type math-verify``: answers compared as mathematics by Hugging Face's Math-Verify
(the optional ``math-verify`` package: ``pip install 'relay-rl[math-verify]'``).

The label is read as LaTeX (as ``\\boxed{label}``); the response's answer is the one
Math-Verify extracts (the last ``\\boxed{}``, a "final answer is" sentence, or a plain
expression), so ``\\sqrt2/2`` and ``\\frac{\\sqrt{2}}{2}``, ``0.5`` and ``\\frac12`` or
``90^\\circ`` and ``90`` are the same answer. Score as verl's math_verify reward: 1.0 when
equal, 0.0 otherwise (no answer, a parse failure or a timeout included); ``acc`` and
``pred`` (the extracted answer as Math-Verify prints it, "" when none) as the dapo reward.

Math-Verify bounds parsing and comparing with ``signal.alarm`` (5 s each), which only works
in the main thread: elsewhere it runs without that bound.
"""

from __future__ import annotations

import threading
from types import ModuleType

MISSING = "--rm-type math-verify needs the math-verify package: pip install 'relay-rl[math-verify]'"
#: seconds Math-Verify may spend parsing one text or comparing two answers (main thread only)
TIMEOUT_S = 5


def require() -> ModuleType:
    """The ``math_verify`` module, or an ImportError that says how to install it."""
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(MISSING) from e
    return math_verify


def grade(response: str, label: str) -> dict:
    """``{"score": 1.0 | 0.0, "acc": bool, "pred": str}`` for a model response."""
    mv = require()
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(f"\\boxed{{{label}}}", extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=timeout)
    pred = mv.parse(response, extraction_config=[mv.ExprExtractionConfig(), mv.LatexExtractionConfig()],
                    parsing_timeout=timeout)
    ok = bool(gold and pred) and bool(mv.verify(gold, pred, timeout_seconds=timeout))
    return {"score": 1.0 if ok else 0.0, "acc": ok, "pred": str(pred[-1]) if pred else ""}
