"""Documents the code points readers at exist in the repository: a ``*.md`` named in a
source, script or config file is a path from the repo root (``docs/launcher.md``) or a
file of the root (``README.md``). Design notes kept outside the repo are not cited."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.unit


def tracked(*patterns: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", *patterns], cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split()
    return [
        os.path.relpath(os.path.join(d, f), ROOT)
        for d, _, files in os.walk(ROOT)
        if "/." not in d
        for f in files
        if any(f.endswith(p.lstrip("*")) for p in patterns)
    ]


def test_every_markdown_file_the_code_cites_exists():
    missing = []
    for rel in tracked("*.py", "*.sh", "*.yaml", "*.toml"):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            text = f.read()
        for lineno, line in enumerate(text.splitlines(), 1):
            for ref in re.findall(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.md\b", line):
                if not os.path.isfile(os.path.join(ROOT, ref)):
                    missing.append(f"{rel}:{lineno}: {ref}")
    assert not missing, "cited documents that are not in the repository (point at docs/*.md instead):\n" + "\n".join(
        missing
    )
