"""``--rm-type dapo-genrm``: an LLM judge decides whether a response's final answer matches
the reference, as the original system's ``relax/engine/rewards/dapo_genrm.py`` does.

Two variants (``--genrm-reward-variant``):

- ``documented`` (default): the implementation the original's GenRM documentation shows
  ("Reward Configuration"): :data:`DAPO_GENRM_PROMPT_TEMPLATE`, the answer is the text
  after the last ``Answer:`` (else the last 300 characters), a strict verdict (only a
  reply that is exactly "1" after stripping scores 1) and ``{"score", "acc", "pred"}`` with
  ``pred`` the judge's stripped reply.
- ``boxed``: the original's newer revision (as described by the notes on it): five in-context examples, the
  answer is the last brace-balanced ``\\boxed{}`` (else the last ``Answer:`` line), a
  missing or over-long answer scores 0 without asking the judge, and a loose verdict (the
  text after the last ``Judgement:``; 1 when its first 16 characters contain "1").

Beyond the original, both variants keep this project's contract: the judge is any
``async (messages) -> str`` (in a job: the ZeroMQ judge client), a judge failure after its
retries scores 0 with ``format_error="judge_error"`` and never fails the step (with
``--use-fault-tolerance`` launcher/rl/scoring.py judges such samples again), and the
result also carries ``judge_response`` (the full reply; ``reward/judged`` counts it) and
``format_error`` ("" when the verdict was read).
"""

from __future__ import annotations

import functools
import logging
import re
import string
from collections.abc import Awaitable, Callable

log = logging.getLogger("relay.reward")

# The documented template. Where each line comes from:
# - "Below are two answers to a question." and the four lines from "[Question]:" to
#   "Judgement:" (incl. the space in "[Model_answer] :" and no newline after "Judgement:")
#   are verbatim from the original's GenRM documentation ("Reward Configuration").
# - The documentation elides the instruction between them ("..."). The lines in between
#   are our reconstruction: they say what the field names and the documented strict
#   parse imply (the judge compares [Model_answer] with [Standard Answer] and replies with
#   a bare 1 or 0), in the manner of the public LLM-as-judge prompts that use this exact
#   field layout; they are not the original's words.
DAPO_GENRM_PROMPT_TEMPLATE = """Below are two answers to a question. [Question] is the question, [Standard Answer] is \
the standard answer to the question, and [Model_answer] is the answer extracted from a model's output to this \
question. Determine whether these two answers are consistent.
The answers are consistent when they are essentially the same, even if they are written differently \
(for example, '1/2' and '0.5', or 'x = 3' and '3').
If they are consistent, the Judgement is 1; if they are different, the Judgement is 0. \
Output only the Judgement (1 or 0) and nothing else.

[Question]: {question}
[Standard Answer]: {ground_truth}
[Model_answer] : {predict_str}
Judgement:"""

# The newer revision's prompt: the notes on it say it has five in-context examples; their
# text is not documented, so these five (ours) show the format and both verdicts.
_EXAMPLES = (
    ("What is 3 + 4?", "7", "7", 1),
    ("Simplify 2/4.", "\\frac{1}{2}", "0.5", 1),
    ("Solve x^2 = 9 for x > 0.", "3", "x = 3", 1),
    ("How many sides does a hexagon have?", "6", "8", 0),
    ("What is the smallest prime number?", "2", "1", 0),
)
BOXED_PROMPT_TEMPLATE = (
    DAPO_GENRM_PROMPT_TEMPLATE.split("\n\n[Question]:")[0]
    + "\n\n"
    + "".join(f"[Question]: {q}\n[Standard Answer]: {a}\n[Model_answer] : {m}\nJudgement: {v}\n\n"
              for q, a, m, v in _EXAMPLES).replace("{", "{{").replace("}", "}}")
    + "[Question]: {question}\n[Standard Answer]: {ground_truth}\n[Model_answer] : {predict_str}\nJudgement:"
)

#: the previous default prompt of this project (kept for ``--genrm-prompt-template`` users
#: who copied it); a template may name the answer {answer} (stripped) or {predict_str}
#: (exactly as extracted) and the reference {label} or {ground_truth}
PROMPT = (
    "You are grading a math answer. Decide whether the model's final answer is mathematically "
    "equivalent to the reference answer (ignore formatting, units and the working).\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{label}\n\n"
    "Model's final answer:\n{answer}\n\n"
    "Reply with a single character: 1 if they match, 0 if they do not."
)

VARIANTS = ("documented", "boxed")
TAIL_CHARS = 300  # documented: no "Answer:" -> the response's last 300 characters
MAX_ANSWER_CHARS = 500  # boxed: a longer answer scores 0 without a judge call ("answer_too_long")
VERDICT_CHARS = 16  # boxed: the verdict is read from this many characters after the last "Judgement:"
_THINK = re.compile(r"<think>.*?</think>", re.S)
_BIT = re.compile(r"(?<![\w.])([01])(?![\w.])")
_FIELDS = {"question", "label", "ground_truth", "answer", "predict_str"}
#: chat-template control tokens (``<|im_end|>``, ``</s>``, ``[INST]``...): pasted into the
#: judge's prompt they would end its user turn and start a reply the policy wrote
_CONTROL = re.compile(r"<\|[^<>|\s]{1,40}\|>|</?s>|\[/?INST\]")
#: a line's leading field label in a judge template ("[Standard Answer]:", "Reference:")
_LABEL = re.compile(r"^\s*(\[?[A-Za-z][A-Za-z_ ]{0,30}\]?\s*:)", re.M)
#: the judge's verdict markers, always defused, whatever the template
_VERDICT_MARKERS = ("Judgement:", "Judgment:")


def extract_answer(response: str) -> str:
    """The documented extraction, exactly: ``response.split("Answer:")[-1]`` when the
    response has "Answer:", else its last 300 characters (not stripped)."""
    if "Answer:" in response:
        return response.split("Answer:")[-1]
    return response[-TAIL_CHARS:]


@functools.lru_cache(maxsize=32)
def template_markers(template: str | None) -> re.Pattern:
    """What would read as the judge prompt's own structure, as one pattern: each line's
    leading field label in ``template`` and in the documented template (``[Question]:``,
    ``[Standard Answer]:``, ``Reference:``...; any case, any space before the colon), the
    verdict markers, and chat-template control tokens."""
    labels = set(_VERDICT_MARKERS)
    for text in {template or DAPO_GENRM_PROMPT_TEMPLATE, DAPO_GENRM_PROMPT_TEMPLATE}:
        labels.update(m.strip() for m in _LABEL.findall(text))
    labels.discard("Answer:")  # the extraction already took the text after the last one
    alternatives = sorted((re.escape(label[:-1].strip()) + r"\s*:" for label in labels), key=len, reverse=True)
    return re.compile("|".join([*alternatives, _CONTROL.pattern]), re.I)


def guard_answer(answer: str, markers: re.Pattern, from_tail: bool = False) -> str:
    """Only the final answer region of ``answer`` (what the extraction gave), so that the
    policy's text is not read as the judge's instructions: its first non-empty line, a
    display math block opened there included. With ``from_tail`` (no "Answer:": the
    extraction fell back to the response's tail) the line holding the tail's last balanced
    ``\\boxed{}`` (the chatter after it cut), else the tail's last non-empty line. Cut before
    the first of ``markers`` (:func:`template_markers`: "Judgement:", the template's field
    labels, chat-template control tokens); at most 500 characters. The leading whitespace is
    kept as extracted, so an ordinary one-line answer reaches the judge exactly as the
    original sends it."""
    lead = answer[: len(answer) - len(answer.lstrip())]
    lines = [line for line in answer.strip().split("\n") if line.strip()]
    if not lines:
        return answer
    if from_tail:
        region = _boxed_line(lines) or lines[-1]
    else:
        region, closer = lines[0], {"$$": "$$", "\\[": "\\]"}.get(lines[0].strip())
        if closer is not None:  # "$$" / "\[" alone on the line: the block up to its closer
            end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == closer), len(lines) - 1)
            region = "\n".join(lines[: end + 1])
    marker = markers.search(region)
    kept = region[: len(region) if marker is None else marker.start()][:MAX_ANSWER_CHARS].rstrip()
    return answer if kept == answer.strip() else lead + kept


def _boxed_line(lines: list[str]) -> str | None:
    """The line holding the last balanced ``\\boxed{...}`` of ``lines``, up to the end of that
    box and the math or punctuation closing it (``$``, ``.``, ``)``...): what follows on the
    line is chatter. A box spread over lines is not taken (None)."""
    for line in reversed(lines):
        start = line.rfind("\\boxed{")
        if start < 0:
            continue
        inner = last_boxed(line[start:])
        if inner is None:
            return None
        end = start + len("\\boxed{") + len(inner) + 1
        while end < len(line) and line[end] in "$.)]}!,; ":
            end += 1
        return line[:end].rstrip()
    return None


def judged_answer(response: str, variant: str = "documented", template: str | None = None,
                  guard: bool = True) -> str:
    """The answer the judge is shown for ``response``: the variant's extraction
    (:func:`extract_answer` or :func:`boxed_answer`), then :func:`guard_answer` unless
    ``guard`` is off (the original's extraction, verbatim)."""
    answer = boxed_answer(response) if variant == "boxed" else extract_answer(response)
    if not guard:
        return answer
    from_tail = variant != "boxed" and "Answer:" not in response
    return guard_answer(answer, template_markers(template), from_tail)


def final_answer(response: str) -> str:
    """:func:`extract_answer`, stripped (for comparisons and custom templates' {answer})."""
    return extract_answer(response).strip()


def last_boxed(text: str) -> str | None:
    """The content of the last brace-balanced ``\\boxed{...}``, or None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len("\\boxed{") : i - 1]
        start = text.rfind("\\boxed{", 0, start)
    return None


def boxed_answer(response: str) -> str:
    """The newer revision's extraction: the last balanced ``\\boxed{}``, else the rest of
    the line after the last ``Answer:``; "" when there is neither."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    if "Answer:" in response:
        return response.split("Answer:")[-1].split("\n")[0].strip()
    return ""


def judge_messages(question: str, label: str, response: str, template: str | None = None,
                   answer: str | None = None) -> list[dict]:
    """One user turn: ``template`` (default :data:`DAPO_GENRM_PROMPT_TEMPLATE`) filled with
    the question, the reference and the response's answer (``answer``, else
    :func:`extract_answer` of ``response``)."""
    predict_str = extract_answer(response) if answer is None else answer
    text = (template or DAPO_GENRM_PROMPT_TEMPLATE).format(
        question=question, ground_truth=label, label=label, predict_str=predict_str, answer=predict_str.strip()
    )
    return [{"role": "user", "content": text}]


def check_template(template: str) -> str:
    """A judge prompt template may use {question}, {label} or {ground_truth}, and {answer}
    or {predict_str} (one of which it must use)."""
    try:
        names = {f[1] for f in string.Formatter().parse(template) if f[1] is not None}
    except ValueError as e:
        raise ValueError(f"--genrm-prompt-template is not a valid format string: {e}") from None
    bad = names - _FIELDS
    if bad or not names & {"answer", "predict_str"}:
        raise ValueError(
            "--genrm-prompt-template may use {question}, {label} or {ground_truth}, {answer} or {predict_str} (and "
            f"must use {{answer}} or {{predict_str}}); got {sorted(names)}"
        )
    return template


def parse_verdict(text: str, mode: str = "strict") -> int | None:
    """``strict`` (the documented parse): only an exact "1" (after stripping whitespace) is
    1, an exact "0" is 0. ``loose``: drop ``<think>...</think>``, then take the last
    standalone 0 or 1. ``boxed``: the text after the last "Judgement:" (or the whole reply),
    1 when its first 16 characters contain "1", else 0. None: the reply cannot be read."""
    if mode == "strict":
        t = text.strip()
        return 1 if t == "1" else 0 if t == "0" else None
    if mode == "loose":
        bits = _BIT.findall(_THINK.sub("", text))
        return int(bits[-1]) if bits else None
    if mode == "boxed":
        head = text.split("Judgement:")[-1].strip()[:VERDICT_CHARS]
        return 1 if "1" in head else 0
    raise ValueError("parse mode must be 'strict', 'loose' or 'boxed'")


def question_and_label(sample) -> tuple[str, str]:
    """``metadata["question"]`` (else the prompt: its last user turn when it is a chat) and
    ``metadata["label"]`` (else ``label``), as the original reads them."""
    meta = sample.get("metadata") or {}
    question = meta.get("question") or sample.get("prompt") or ""
    if isinstance(question, list):  # chat messages: the last user turn
        question = next((m.get("content", "") for m in reversed(question) if m.get("role") == "user"), "")
    return str(question), str(meta.get("label", sample.get("label", "")))


async def score(
    sample,
    judge: Callable[[list[dict]], Awaitable[str]],
    parse: str = "strict",
    report: Callable[[bool], None] | None = None,
    template: str | None = None,
    variant: str = "documented",
    guard: bool = True,
) -> dict:
    """Score one sample (a :class:`~launcher.rl.sample.Sample` or a dict with ``response``,
    ``label`` and ``metadata``/``prompt``). ``documented``: {score, acc, pred (the judge's
    stripped reply), judge_response, format_error}; ``parse`` is ``strict`` (the original)
    or ``loose``. ``boxed``: {score, acc, pred (the extracted answer), judge_response,
    format_error}; the verdict is always read the boxed way. ``guard``: the judge sees only
    the answer's final region, defused (:func:`guard_answer`)."""
    if variant not in VARIANTS:
        raise ValueError(f"dapo-genrm variant must be one of {VARIANTS}, got {variant!r}")
    question, label = question_and_label(sample)
    response = sample.get("response", "") or ""
    answer = judged_answer(response, variant, template, guard)
    if variant == "boxed":
        raw = boxed_answer(response)  # gated as extracted, before the guard shortens it
        gate = "answer_missing" if not answer.strip() else "answer_too_long" if len(raw) > MAX_ANSWER_CHARS else ""
        if gate:
            return {"score": 0.0, "acc": 0, "pred": answer, "judge_response": "", "format_error": gate}
        template = template or BOXED_PROMPT_TEMPLATE
        parse = "boxed"
    try:
        reply = await judge(judge_messages(question, label, response, template, answer))
    except Exception as e:  # noqa: BLE001 (the contract: never crash the step)
        log.warning("judge call failed after retries: %s", e)
        return {"score": 0.0, "acc": 0, "pred": answer if variant == "boxed" else "", "judge_response": "",
                "format_error": "judge_error"}
    verdict = parse_verdict(reply, parse)
    if report is not None:
        report(verdict is not None)
    pred = answer if variant == "boxed" else reply.strip()
    if verdict is None:
        return {"score": 0.0, "acc": 0, "pred": pred, "judge_response": reply, "format_error": "parse_error"}
    return {"score": float(verdict), "acc": int(verdict), "pred": pred, "judge_response": reply, "format_error": ""}
