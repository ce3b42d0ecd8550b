"""The demo's bar with mixture-of-experts and hybrid models: ``relay demo --arch qwen3_moe``
and ``relay demo --arch qwen3_5_moe`` (as a user types them) teach a tiny judge, warm up a
tiny policy of that architecture (Qwen3-MoE; Qwen3.5: Gated DeltaNet + gated attention +
MoE with a shared expert) and run GRPO with the judge through the whole stack; the held-out
accuracy must rise by at least 10 points (the command exits 1 otherwise) in the default 60 GRPO
steps (2 CPU cores, 2026-12-04: 53 and 84 points; 40 steps once gave only 16). The judges train their
full 600 SFT steps: a MoE judge cut to 300 (held-out 0.90) said 1 to 4-for-9 and 9-for-1, and
the policy learned those answers (exact accuracy 0.315 -> 0.09 while the judge's rose)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_relay_demo_with_moe_or_hybrid_policy_and_judge_passes_the_bar(arch, tmp_path):
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([RELAY, "demo", "--arch", arch], cwd=ROOT, capture_output=True, text=True,
                       timeout=1150, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"random {arch} shapes, 2 layers" in p.stdout
    before, after = map(float, re.search(r"greedy\): ([\d.]+) -> ([\d.]+)", p.stdout).groups())
    assert after - before >= 0.10
    for model in ("judge", "policy-warm"):
        with open(tmp_path / "cache" / arch / "demo" / model / "config.json") as f:
            assert json.load(f)["model_type"] == arch
