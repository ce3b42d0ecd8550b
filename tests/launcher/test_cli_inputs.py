"""Hostile values on the ``relay`` command line, run literally as a user types them: each is
refused at once with exit code 2 and a message naming the flag and what to use, and nothing
starts or is written (a port past 65535 once wrapped around silently: 99999 served on 34463)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def relay(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"))
    return subprocess.run([RELAY, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, message",
    [
        (["judge", "--config", "tiny-cpu-split", "--port", "99999"],
         "argument --port: 99999 is out of range: use 0-65535"),
        (["judge", "--config", "tiny-cpu-split", "--port", "-1"], "argument --port: -1 is out of range: use 0-65535"),
        (["judge", "--config", "tiny-cpu-split", "--port", "8o"], "argument --port: '8o' is not a port number"),
        (["judge", "--config", "tiny-cpu-split", "--host", "256.1.1.1", "--port", "0"],
         "the judge gateway cannot listen on 256.1.1.1:0 (Name or service not known); check the host"),
        (["sbatch", "--config", "tiny-cpu-split", "--nodes", "0"], "argument --nodes: 0 is out of range: use >= 1"),
        (["sbatch", "--config", "tiny-cpu-split", "--nodes", "1", "--gpus-per-node", "0"],
         "argument --gpus-per-node: 0 is out of range: use >= 1"),
        (["sbatch", "--config", "tiny-cpu-split", "--nodes", "1", "--signal-grace", "-5"],
         "argument --signal-grace: -5 is out of range: use >= 0"),
        (["sbatch", "--config", "tiny-cpu-split", "--nodes", "1", "--port", "70000"],
         "argument --port: 70000 is out of range: use 1-65535"),
        (["demo", "--steps", "0"], "argument --steps: 0 is out of range: use >= 1"),
        (["demo", "--runtime", "--procs", "100000"], "argument --procs: 100000 is out of range: use 2-64"),
        (["make-model", "--out", "/proc/relay-model"], "relay make-model: cannot write to --out /proc/relay-model"),
        (["make-model", "--out", "model", "--layers", "0"], "relay make-model: --layers must be at least 1, got 0"),
        (["make-model", "--out", "model", "--fp8-block", "-2"], "--fp8-block must be 0 (off) or a block size, got -2"),
        (["export-hf", "nope", "--out", "model"], "relay export-hf: nope: no such checkpoint directory"),
        (["export-hf", "/proc", "--out", "model"],
         "relay export-hf: /proc is not a complete relay trainer checkpoint: it has no relay-checkpoint.json"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag_and_nothing_is_written(tmp_path, args, message):
    p = relay(tmp_path, *args)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert message in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "judge ready" not in p.stdout
    assert not (tmp_path / "model").exists() and not (tmp_path / "logs").exists()


def test_relay_judge_refuses_a_model_path_that_is_not_a_checkpoint_before_starting_an_engine(tmp_path):
    """A missing or empty model folder once ended ``relay judge`` in a traceback from inside the
    engine's start ("model ... not found" even for a folder that was there)."""
    (tmp_path / "empty").mkdir()
    for path, message in (("nope", "relay judge: missing nope (--genrm-model-path)"),
                          ("empty", "relay judge: --genrm-model-path empty is a folder without config.json, not a "
                                    "model checkpoint")):
        p = relay(tmp_path, "judge", "--config", "tiny-cpu-split", "--genrm-model-path", path, "--port", "0")
        assert p.returncode == 2 and message in p.stderr, (p.returncode, p.stderr[-2000:])
        assert "Traceback" not in p.stderr and "judge ready" not in p.stdout


@pytest.mark.parametrize("variable, value", [("RELAY_TRAINER_CPU_THREADS", "-1"), ("RELAY_HEARTBEAT_TIMEOUT", "0")])
def test_a_bad_relay_variable_is_named_in_one_line_before_anything_runs(tmp_path, variable, value):
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), **{variable: value})
    p = subprocess.run([RELAY, "train", "--config", "tiny-cpu-split"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith(f"relay: {variable} must be"), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "runs").exists()
