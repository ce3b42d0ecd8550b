"""``--rm-type dapo-genrm``: an LLM judge decides whether a response's final answer matches
the reference. The judge is any ``async (messages) -> str`` (in a job: the ZeroMQ judge
client); a judge failure after its retries scores 0 with ``format_error="judge_error"``
and never fails the training step."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

log = logging.getLogger("relay.reward")

PROMPT = (
    "You are grading a math answer. Decide whether the model's final answer is mathematically "
    "equivalent to the reference answer (ignore formatting, units and the working).\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{label}\n\n"
    "Model's final answer:\n{answer}\n\n"
    "Reply with a single character: 1 if they match, 0 if they do not."
)

TAIL_CHARS = 300
_THINK = re.compile(r"<think>.*?</think>", re.S)
_BIT = re.compile(r"(?<![\w.])([01])(?![\w.])")


def final_answer(response: str) -> str:
    """The text after the last ``Answer:``, else the last 300 characters."""
    idx = response.rfind("Answer:")
    if idx >= 0:
        return response[idx + len("Answer:") :].strip()
    return response[-TAIL_CHARS:].strip()


def judge_messages(question: str, label: str, response: str, template: str | None = None) -> list[dict]:
    """One user turn: ``template`` (default :data:`PROMPT`) filled with the question, the
    reference and the response's final answer."""
    text = (template or PROMPT).format(question=question, label=label, answer=final_answer(response))
    return [{"role": "user", "content": text}]


def check_template(template: str) -> str:
    """A judge prompt template may use only {question}, {label} and {answer}, and must use {answer}."""
    import string

    try:
        names = {f[1] for f in string.Formatter().parse(template) if f[1] is not None}
    except ValueError as e:
        raise ValueError(f"--genrm-prompt-template is not a valid format string: {e}") from None
    bad = names - {"question", "label", "answer"}
    if bad or "answer" not in names:
        raise ValueError(
            f"--genrm-prompt-template may use {{question}}, {{label}}, {{answer}} (and must use {{answer}}); got "
            f"{sorted(names)}"
        )
    return template


def parse_verdict(text: str, mode: str = "strict") -> int | None:
    """``strict``: only an exact "1" (after stripping whitespace) is 1, an exact "0" is 0.
    ``loose``: drop ``<think>...</think>``, then take the last standalone 0 or 1.
    Returns None when the reply cannot be read (a parse failure)."""
    if mode not in ("strict", "loose"):
        raise ValueError("parse mode must be 'strict' or 'loose'")
    if mode == "strict":
        t = text.strip()
        return 1 if t == "1" else 0 if t == "0" else None
    bits = _BIT.findall(_THINK.sub("", text))
    return int(bits[-1]) if bits else None


async def score(
    sample: dict,
    judge: Callable[[list[dict]], Awaitable[str]],
    parse: str = "strict",
    report: Callable[[bool], None] | None = None,
    template: str | None = None,
) -> dict:
    """``sample`` has ``response`` and ``label`` (or ``metadata.label``) and the question in
    ``metadata.question`` (or ``prompt``). Returns {score, acc, pred, judge_response, format_error}."""
    meta = sample.get("metadata") or {}
    question = meta.get("question") or sample.get("prompt") or ""
    if isinstance(question, list):  # chat messages: the last user turn
        question = next((m.get("content", "") for m in reversed(question) if m.get("role") == "user"), "")
    label = str(meta.get("label", sample.get("label", "")))
    response = sample.get("response", "")
    pred = final_answer(response)
    try:
        reply = await judge(judge_messages(question, label, response, template))
    except Exception as e:  # noqa: BLE001 (the contract: never crash the step)
        log.warning("judge call failed after retries: %s", e)
        return {"score": 0.0, "acc": False, "pred": pred, "judge_response": "", "format_error": "judge_error"}
    verdict = parse_verdict(reply, parse)
    if report is not None:
        report(verdict is not None)
    if verdict is None:
        return {"score": 0.0, "acc": False, "pred": pred, "judge_response": reply, "format_error": "parse_error"}
    return {"score": float(verdict), "acc": bool(verdict), "pred": pred, "judge_response": reply, "format_error": ""}
