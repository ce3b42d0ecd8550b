"""Rule-based math grading for ``--rm-type dapo``: the DAPO reference grader's behaviour.

:func:`grade` behaves as verl's ``verl/utils/reward_score/math_dapo.py`` ``compute_score``
(the rule slime ships as ``--rm-type dapo``; verl commit b178a3cd, checked case by case
against it in tests/reward/test_dapo_reference.py), written here:

- only the last 300 characters of the response are read;
- the answer is the rest of the line after the last ``Answer:`` (any case, spaces allowed
  around the colon); ``\\boxed{}`` alone is *not* an answer. No answer: ``pred`` is
  ``"[INVALID]"`` (normalized like any other prediction);
- answer and label are normalized alike (:func:`dapo_normalize`: the text after the last
  ``=``, spaces and a fixed list of units and words removed, the first ``$...$`` of a line,
  ``\\text{}`` / ``\\textbf{}`` / ``\\overline{}`` / ``\\boxed{}`` unwrapped, ``\\fracab`` and
  ``\\sqrta`` braced, thousands commas of a plain integer dropped) and compared as strings:
  ``\\frac{1}{2}``, ``1/2`` and ``0.5`` are three different answers, as in the reference;
- ``{"score": 1.0 | -1.0, "acc": bool, "pred": normalized answer}``.

:func:`normalize`, :func:`is_equiv` and :func:`numeric_value` are a separate, lenient
equivalence (exact fractions, ``\\dfrac``, degrees, percent, units, ``x =``) that the judge's
drift audit (reward/integrity.py) compares bare answers with; the ``dapo`` reward does not
use them. :func:`last_boxed` is a helper for callers that read ``\\boxed{}``.
"""

from __future__ import annotations

import re
from fractions import Fraction

# ------------------------------------------------------------------ the dapo reward

#: how much of the response's end is read (the reference's window)
TAIL_CHARS = 300
#: the prediction of a response without an ``Answer:`` line
NO_ANSWER = "[INVALID]"
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

#: literal replacements, applied one after another in this order
_REPLACE = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
#: then these are deleted, in this order
_DELETE = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)


def extract_answer(text: str) -> str | None:
    """The rest of the line after the last ``Answer:`` in ``text`` (case-insensitive; the
    answer may start on the next line when nothing follows the colon), or None."""
    found = None
    for m in _ANSWER_LINE.finditer(text):
        found = m.group(1)
    return found


def _first_math_span(s: str) -> str:
    """Each line holding two ``$`` or more becomes ``$`` + the text between its first two + ``$``."""
    lines = s.split("\n")
    for n, line in enumerate(lines):
        pieces = line.split("$", 2)
        if len(pieces) == 3:
            lines[n] = f"${pieces[1]}$"
    return "\n".join(lines)


def _unwrap_to_brace(s: str, opener: str, last: bool = False) -> str:
    """Left to right, ``opener`` + body + ``}`` becomes body, where the ``}`` is the first one
    after the opener on its line (``last``: the last one on its line); an opener with no
    such ``}`` is left as it is."""
    out, pos, search = [], 0, 0
    while True:
        start = s.find(opener, search)
        if start < 0:
            break
        body = start + len(opener)
        line_end = s.find("\n", body)
        line_end = len(s) if line_end < 0 else line_end
        close = s.rfind("}", body, line_end) if last else s.find("}", body, line_end)
        if close < 0:
            search = start + 1
            continue
        out += [s[pos:start], s[body:close]]
        pos = search = close + 1
    out.append(s[pos:])
    return "".join(out)


def _brace_shorthand(s: str, command: str, arity: int) -> str:
    """``\\fracab`` -> ``\\frac{a}{b}`` (arity 2), ``\\sqrta`` -> ``\\sqrt{a}`` (arity 1): after
    ``command`` a first character other than ``{`` (the second any but a newline) is braced."""
    out, pos, search = [], 0, 0
    while True:
        start = s.find(command, search)
        if start < 0:
            break
        args = s[start + len(command) : start + len(command) + arity]
        if len(args) < arity or args[0] == "{" or (arity == 2 and args[1] == "\n"):
            search = start + 1
            continue
        out += [s[pos:start], command, *(f"{{{c}}}" for c in args)]
        pos = search = start + len(command) + arity
    out.append(s[pos:])
    return "".join(out)


def dapo_normalize(answer: str) -> str:
    """An answer (or label) as the DAPO reference grader compares it."""
    s = answer.rsplit("=", 1)[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for word in _DELETE:
        s = s.replace(word, "")
    s = _first_math_span(s)
    for opener in ("\\text{", "\\textbf{", "\\overline{"):
        s = _unwrap_to_brace(s, opener)
    s = _unwrap_to_brace(s, "\\boxed{", last=True)
    s = _brace_shorthand(s, "frac", 2)
    s = _brace_shorthand(s, "sqrt", 1)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def grade(response: str, label: str) -> dict:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``: the DAPO reference's verdict on
    ``response`` against ``label``."""
    answer = extract_answer(response[-TAIL_CHARS:])
    pred = dapo_normalize(NO_ANSWER if answer is None else answer)
    ok = pred == dapo_normalize(str(label))
    return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": pred}


# ------------------------------------------------------------------ lenient helpers

_UNITS = (
    "degrees", "degree", "units", "unit", "cm", "meters", "meter", "m", "km", "inches", "inch", "feet", "foot", "ft",
    "dollars", "dollar", "cents", "cent", "hours", "hour", "minutes", "minute", "seconds", "second", "sq", "square",
    "mph", "kg", "g", "pounds", "pound", "lbs", "days", "day", "years", "year", "people", "students", "ways",
)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        m = re.match(r"\\boxed\s+([^\s$]+)", text[start:])  # \boxed 5
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _closing(s: str, k: int) -> int:
    """Index of the brace closing the one at ``s[k]`` (len(s) if unbalanced)."""
    depth = 0
    while k < len(s):
        if s[k] == "{":
            depth += 1
        elif s[k] == "}":
            depth -= 1
            if depth == 0:
                return k
        k += 1
    return k


def _unwrap(cmd: str, s: str) -> str:
    """Replace ``\\cmd{x}`` by ``x`` (balanced braces), everywhere."""
    out, i, key = [], 0, "\\" + cmd + "{"
    while True:
        j = s.find(key, i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        k = _closing(s, j + len(key) - 1)
        out.append(s[j + len(key) : k])
        i = k + 1


def _fracs(s: str) -> str:
    """``\\frac{a}{b}`` -> ``(a)/(b)``; also ``\\frac12`` -> ``1/2``."""
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)
    while "\\frac{" in s:
        j = s.find("\\frac{")
        parts, k = [], j + len("\\frac")
        for _ in range(2):
            if k >= len(s) or s[k] != "{":
                return s
            start, k = k, _closing(s, k)
            parts.append(s[start + 1 : k])
            k += 1
        a, b = parts
        a = a if re.fullmatch(r"-?[\w.]+", a) else f"({a})"
        b = b if re.fullmatch(r"-?[\w.]+", b) else f"({b})"
        s = s[:j] + f"{a}/{b}" + s[k:]
    return s


def normalize(ans: str) -> str:
    s = ans.strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for cmd in ("text", "textbf", "mathrm", "mathbf", "boxed", "mbox"):
        s = _unwrap(cmd, s)
    for tok in ("\\$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "\\displaystyle"):
        s = s.replace(tok, "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("°", "").replace("\\degree", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _fracs(s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = s.strip().rstrip(".").strip()
    words = s.split()
    while len(words) > 1 and words[-1].lower().strip(".") in _UNITS:
        words.pop()
    s = " ".join(words)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    s = s.replace(" ", "").replace("\\cdot", "*")
    return s


def _number(s: str) -> Fraction | None:
    t = s.replace("{", "").replace("}", "")
    t = re.sub(r"^\((-?[\d.]+)\)$", r"\1", t)
    m = re.fullmatch(r"(-?)\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", t)
    try:
        if m:
            sign = -1 if m.group(1) else 1
            return sign * Fraction(m.group(2)) / Fraction(m.group(3))
        if re.fullmatch(r"-?\d+(\.\d+)?|-?\.\d+", t):
            return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def numeric_value(text: str) -> Fraction | None:
    """The exact number ``text`` denotes after normalization ("\\frac{1}{2}", "1,000",
    "50%"...), or None when it is not a number."""
    return _number(normalize(text))


def is_equiv(pred: str, label: str) -> bool:
    a, b = normalize(pred), normalize(label)
    if a == b:
        return True
    na, nb = _number(a), _number(b)
    return na is not None and nb is not None and na == nb
