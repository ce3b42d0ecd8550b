"""The post-process hook runs on every training batch, in Split too (the original's
``post_process_rewards``), not only in Defer-swap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.test_grpo_modes import ROOT, records, train_cmd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600, func_only=True)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
HOOK = "examples.generate_reward_model.post_process_genrm_swap.custom_reward_post_process"


def test_the_documented_hook_scores_every_split_batch_after_the_inline_reward(data, tmp_path):
    """Split with the inline dapo-genrm reward and the documented hook: each step, every sample
    is judged inline (32 requests), then by the hook with the same messages (32 answers from
    the judgment cache); the trained rewards are the hook's verdicts. Inline requests whose
    message an earlier, finished request already had (two samples giving the same short
    answer) are answered from the cache too, so the hits are at least the hook's 32: how many
    more depends on which identical requests overlap in time."""
    run_dir = str(tmp_path / "run")
    cmd = [RELAY, *train_cmd("tiny-cpu-split", data, run_dir, "--custom-reward-post-process-path", HOOK)[3:]]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, RELAY_CACHE=data["cache"]))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = records(run_dir)
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        assert r["samples"] == 32 and r["reward/judged"] == 32
        assert r["judge/requests"] == 64 and 32 <= r["judge/cache_hits"] < 64, r
