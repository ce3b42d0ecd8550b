"""End to end: a training prompt longer than the rollout engines take is an error when the
job starts (naming the file, the rows and the lengths), not a failed step later."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.e2e.test_grpo_modes import ROOT, train_cmd
from tests.helpers import tagged_pids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300, func_only=True)]


def test_a_prompt_beyond_the_rollout_engines_context_stops_the_job_at_start(data, tmp_path):
    rows = [{"prompt": f"What is {n} mod 10?", "label": str(n % 10)} for n in range(10, 40)]
    rows[17] = {"prompt": "Think. " * 700 + "What is 17 mod 10?", "label": "7"}  # ~4,900 tokens > 4,096 positions
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = train_cmd("tiny-cpu-split", data, str(tmp_path / "run"), "--num-rollout", "1", "--prompt-data", str(path))
    env = dict(os.environ, RELAY_CACHE=data["cache"], RELAY_TEST_TAG="context-limit")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert tagged_pids("context-limit") == []
    assert p.returncode == 1, p.stdout[-2000:]
    assert f"--prompt-data {path}: 1 prompt(s) do not fit the rollout engines, which take 4096 tokens" in p.stderr, \
        p.stderr[-2000:]
    assert "row 17, has" in p.stderr and "(rows [17])" in p.stderr
    assert "step 1/1" not in p.stdout  # nothing was generated
