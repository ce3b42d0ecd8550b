"""The version matrix (launcher/versions.py): too old stops with what to install, untested
warns with the tested range, the installed versions pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.versions import TESTED, VersionError, check_versions, installed

pytestmark = pytest.mark.unit


def test_the_installed_versions_are_within_the_matrix():
    assert check_versions(installed()) == []


def test_a_package_older_than_required_stops_with_what_to_install():
    with pytest.raises(VersionError, match=r"torch 2.5.1\+cu124 is installed; this code needs torch >= 2.6 "
                                           r"\(tested: 2.11 to 2.13\): pip install 'torch>=2.6'"):
        check_versions({"torch": "2.5.1+cu124", "transformers": "5.24.0"})


def test_untested_versions_warn_with_the_tested_range_and_bounds_compare_by_their_parts():
    warnings = check_versions({"python": "3.13.1", "torch": "2.14.0", "megatron-core": "0.17.0",
                               "transformers": "5.16.0"})
    assert [w.split(" was not tested")[0] for w in warnings] == [
        "python 3.13.1", "torch 2.14.0", "megatron-core 0.17.0", "transformers 5.16.0"]
    assert "(tested: 2.11 to 2.13)" in warnings[1]
    # the ends themselves, and any patch release within a two-part bound, count as tested
    assert check_versions({"torch": "2.11.0+cu130", "megatron-core": "0.16.5", "transformers": "5.24.3",
                           "python": "3.12.3"}) == []
    assert set(TESTED) == {"python", "torch", "megatron-core", "transformers"}


def test_a_job_checks_versions_before_anything_else():
    """A job entry point checks versions before anything else: here a faked old torch."""
    code = ("import sys, launcher.versions as v; v.installed = lambda: {'torch': '2.0.0'}; "
            "from launcher.cli import main; sys.exit(main(['train', '--config', 'tiny-cpu-split']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "relay train: torch 2.0.0 is installed; this code needs torch >= 2.6" in p.stderr


def test_setup_installs_under_the_tested_upper_ends():
    """scripts/constraints.txt caps each installed matrix package just above its tested high end
    (5.25 -> <5.26), so a fresh setup never picks an untried release and the two move together."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    caps = {}
    for line in (root / "scripts" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, bound = line.partition("<")
            caps[name.strip()] = bound.strip()
    assert {"transformers", "megatron-core"} <= set(caps)
    for name, bound in caps.items():
        if name not in TESTED:
            continue
        *head, last = TESTED[name][1].split(".")
        assert bound == ".".join([*head, str(int(last) + 1)]), (name, bound, TESTED[name])
    assert "-c scripts/constraints.txt" in (root / "scripts" / "setup.sh").read_text()
