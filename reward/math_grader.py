"""Rule-based math grading for ``--rm-type dapo``.

The answer is taken from the last ``\\boxed{...}`` (braces balanced), else from the text
after the last ``Answer:``. Answers and labels are normalized (LaTeX wrappers, ``\\frac`` /
``\\dfrac`` / ``\\tfrac``, degrees, percent, units, thousands separators, ``x =``) and
compared as exact fractions when both are numbers, else as normalized strings.
Score as in DAPO: 1.0 when correct, -1.0 otherwise.
"""

from __future__ import annotations

import re
from fractions import Fraction

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


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    idx = text.rfind("Answer:")
    if idx >= 0:
        line = text[idx + len("Answer:") :].strip().split("\n")[0]
        return line.strip() or None
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


def grade(response: str, label: str) -> dict:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str}`` for a model response."""
    pred = extract_answer(response)
    if pred is None:
        return {"score": -1.0, "acc": False, "pred": ""}
    ok = is_equiv(pred, str(label))
    return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": normalize(pred)}
