"""The shell commands of README.md and docs/*.md, read from their fenced ```bash blocks.

A *command* is one logical shell line: backslash continuations and multi-line arrays
(``T=(...)``) are part of it, a trailing comment too. Lines that only assign variables
(``D=.cache/demo``, ``T=(...)``) are not commands: they are the *setup* of the commands
after them in the same block. Blank and comment-only lines are neither. A trailing
``# needs a GPU ...`` comment marks a command that needs GPUs (its reason is the comment).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHELL_FENCES = ("bash", "sh", "shell")
GPU_MARK = re.compile(r"#\s*(needs a GPU\b.*)$")


def doc_files() -> list[str]:
    """README.md and docs/*.md, relative to the repo root."""
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


@dataclass(frozen=True)
class DocCommand:
    doc: str  # e.g. "docs/judge.md"
    line: int  # its first line in the doc (1-based)
    block: int  # index of its fenced block in the doc
    text: str  # exactly as written (continuation lines joined with "\n")
    setup: tuple[str, ...]  # the block's variable assignments before it

    @property
    def gpu(self) -> str | None:
        """The reason it needs a GPU (its trailing ``# needs a GPU ...`` comment), if any."""
        m = GPU_MARK.search(self.text.splitlines()[-1])
        return m.group(1).strip() if m else None

    @property
    def script(self) -> str:
        """What bash runs: the setup lines, then the command."""
        return "\n".join([*self.setup, self.text]) + "\n"

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def shell_blocks(doc: str) -> list[tuple[int, list[str]]]:
    """(line number of the first line inside the fence, its lines) of every shell block."""
    blocks, inside, start, lines = [], None, 0, []
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        for n, line in enumerate(f.read().splitlines(), 1):
            fence = line.strip()
            if inside is None and fence.startswith("```"):
                inside, start, lines = fence[3:].strip().lower(), n + 1, []
            elif inside is not None and fence.startswith("```"):
                if inside in SHELL_FENCES:
                    blocks.append((start, lines))
                inside = None
            elif inside is not None:
                lines.append(line)
    return blocks


def _open_constructs(text: str) -> bool:
    """Whether ``text`` ends inside a quote, an open parenthesis or after a backslash
    continuation (so the logical line goes on)."""
    depth, i, quote = 0, 0, None  # quote: "'", '"' or "$'"
    while i < len(text):
        c = text[i]
        if quote == "'":
            quote = None if c == "'" else quote
        elif quote == "$'":
            if c == "\\":
                i += 1
            elif c == "'":
                quote = None
        elif quote == '"':
            if c == "\\":
                i += 1
            elif c == '"':
                quote = None
        elif c == "\\":
            if i + 1 == len(text):
                return True  # continuation
            i += 1
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n"):
            nl = text.find("\n", i)
            if nl < 0:
                break
            i = nl
            continue
        elif text.startswith("$'", i):
            quote, i = "$'", i + 1
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        i += 1
    return quote is not None or depth > 0


def _only_assigns(text: str) -> bool:
    """``NAME=value`` or ``NAME=( ... )`` and nothing else."""
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", text):
        return False
    if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=\(", text):
        body = re.sub(r"\s+#[^\n]*$", "", text.rstrip())
        return body.endswith(")")
    return len(shlex.split(text, comments=True)) == 1


def commands(doc: str) -> list[DocCommand]:
    """The commands of ``doc``'s shell blocks, in order, with their setup lines."""
    out: list[DocCommand] = []
    for b, (start, lines) in enumerate(shell_blocks(doc)):
        setup: list[str] = []
        logical: list[str] = []
        first = 0
        for n, line in enumerate(lines, start):
            if not logical:
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                first = n
            logical.append(line)
            text = "\n".join(logical)
            if _open_constructs(text):
                continue
            logical = []
            if _only_assigns(text):
                setup.append(text)
            else:
                out.append(DocCommand(doc, first, b, text, tuple(setup)))
        assert not logical, f"{doc}:{first}: a command never ends (open quote, parenthesis or trailing backslash)"
    return out


def count_command_lines(doc: str) -> int:
    """An independent count, by the docs' layout rule: a command starts on an unindented,
    non-blank line that is not a comment and not a variable assignment; its continuation
    lines are indented."""
    n = 0
    for _, lines in shell_blocks(doc):
        for line in lines:
            if not line.strip() or line[0] in " \t" or line.startswith("#"):
                continue
            if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=(\(|\S*(\s+#.*)?$)", line):
                continue
            n += 1
    return n
