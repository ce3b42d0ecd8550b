"""The version matrix: what the code needs (``REQUIRED``, as pyproject.toml states it) and the
versions it was tested with at both ends (``TESTED``: the CPU CI machine and the GPU machine).

:func:`check_versions` runs when a job or a judge starts: a package below what is required
stops it with a message naming the package, its version and what to install; one outside
the tested range gives a warning naming the range (it may work; it was not tried)."""

from __future__ import annotations

import sys
from importlib import metadata

#: package -> the lowest version the code needs (pyproject.toml's dependencies)
REQUIRED = {"torch": "2.6", "megatron-core": "0.16", "transformers": "4.45"}
#: package -> (lowest, highest) version tested: GPU machine (torch 2.11 CUDA, transformers
#: 5.17, Python 3.12) and CPU CI (torch 2.13 CPU, transformers 5.24 and 5.25, Python 3.11);
#: megatron-core 0.16.1 on both (any 0.16.x counts as tested). scripts/setup.sh installs under
#: the upper ends (scripts/constraints.txt): raise both together.
TESTED = {"python": ("3.11", "3.12"), "torch": ("2.11", "2.13"), "megatron-core": ("0.16", "0.16"),
          "transformers": ("5.17", "5.25")}
#: SGLang runs as its own server; the adapter speaks the pinned version's arguments and HTTP API
#: (engines/sglang/protocol.json), tested against a fake of it only
SGLANG_NOTE = ("SGLang: 0.5.15.post1's server arguments and HTTP API (engines/sglang/protocol.json); tested against "
               "a fake server that follows it, not against a real SGLang server")


class VersionError(RuntimeError):
    """An installed package is older than the code needs."""


def _release(text: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.13.0+cpu" -> (2, 13, 0)."""
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _within(version: tuple, low: str, high: str) -> bool:
    """``version`` between ``low`` and ``high``, comparing only as many parts as each bound has."""
    lo, hi = _release(low), _release(high)
    return version[: len(lo)] >= lo and version[: len(hi)] <= hi


def installed() -> dict[str, str | None]:
    """The installed version of each package of the matrix (None when missing), and Python's."""
    out: dict[str, str | None] = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name in TESTED:
        if name == "python":
            continue
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def check_versions(versions: dict[str, str | None] | None = None) -> list[str]:
    """Raise VersionError for a package below ``REQUIRED``; return a warning for each one
    outside ``TESTED``."""
    versions = installed() if versions is None else versions
    warnings = []
    for name, version in versions.items():
        if version is None:
            continue  # a missing package fails where it is imported, saying so
        release = _release(version)
        need = REQUIRED.get(name)
        if need is not None and release < _release(need):
            raise VersionError(f"{name} {version} is installed; this code needs {name} >= {need} "
                               f"(tested: {TESTED[name][0]} to {TESTED[name][1]}): pip install '{name}>={need}'")
        low, high = TESTED[name]
        if not _within(release, low, high):
            warnings.append(f"{name} {version} was not tested (tested: {low} to {high}); "
                            "if something fails, try a tested version")
    return warnings
