"""The e2e tests' models: the demo's first two steps, shortened — a judge taught with
``relay sft`` (restate, then 1/0) and a policy warmed up with ``relay sft`` — so that rewards
from the judge vary within GRPO groups and training really moves the weights."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def relay_sft(cache: str, config: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RELAY_CACHE=cache)
    p = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "sft", "--config", config, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """{cache, data paths, judge, policy, judge_sft_stdout}: models under ``cache/demo``.

    ``RELAY_E2E_CACHE=DIR`` (for developers iterating on e2e tests; CI leaves it unset) keeps
    the models in DIR and reuses them when a complete earlier build is there."""
    from engines.models.model_builder import make_model
    from launcher.demo_task import write_demo_data

    cache = os.environ.get("RELAY_E2E_CACHE") or str(tmp_path_factory.mktemp("e2e-cache"))
    root = os.path.join(cache, "demo")
    done = os.path.join(root, "e2e-models-complete.txt")  # the judge SFT's stdout, written last
    paths = write_demo_data(os.path.join(root, "data"))
    if not os.path.exists(done):
        make_model("qwen3", "tiny", os.path.join(root, "policy-base"), seed=1)
        make_model("qwen3", "tiny", os.path.join(root, "judge-base"), seed=7)
        judge = relay_sft(cache, "demo-judge-sft", "--sft-steps", "300", "--eval-interval", "150")
        relay_sft(cache, "demo-policy-sft")
        with open(done, "w") as f:
            f.write(judge.stdout)
    with open(done) as f:
        judge_stdout = f.read()
    return {
        **paths,
        "cache": cache,
        "judge": os.path.join(root, "judge"),
        "policy": os.path.join(root, "policy-warm"),
        "judge_sft_stdout": judge_stdout,
        "judge_sft_run": os.path.join(root, "runs", "judge-sft"),
    }


@pytest.fixture
def data(trained):
    return trained


@pytest.fixture(scope="session")
def split_run(trained, tmp_path_factory) -> str:
    """The run directory of one default ``relay train --config tiny-cpu-split`` run (2 steps),
    shared by the tests that read it (the Split checks, the 2-node comparison)."""
    from tests.e2e.test_grpo_modes import run_train

    run_dir = str(tmp_path_factory.mktemp("split-run") / "run")
    run_train("tiny-cpu-split", trained, run_dir)
    return run_dir
