"""Experiment trackers (issue 48): TensorBoard event files and an offline wandb run get the
records metrics.jsonl gets, wandb the resolved config; a tracker whose package is missing is
refused before the job starts, naming the flag and what to install."""

from __future__ import annotations

import sys

import pytest

from launcher.config import ConfigError, load_config
from launcher.config.checks import check_job
from launcher.metrics import MetricsLog, read_metrics
from launcher.trackers import Trackers

RECORDS = [{"kind": "train", "step": 1, "reward/mean": 0.25, "train/loss": 1.5, "note": "text"},
           {"kind": "train", "step": 2, "reward/mean": 0.75, "train/loss": 1.0, "flag": True}]


def test_tensorboard_event_files_hold_the_metrics_records(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config("tiny-cpu-split", {"use_tensorboard": True, "run_dir": str(tmp_path)})
    log = MetricsLog(str(tmp_path), 2, out=open("/dev/null", "w"), trackers=Trackers(cfg, str(tmp_path)))
    for record in RECORDS:
        log.write(record)
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward/mean", "train/loss"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [r["reward/mean"] for r in read_metrics(str(tmp_path))] == [0.25, 0.75]  # the same records


def test_an_offline_wandb_run_gets_the_records_and_the_resolved_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config("tiny-cpu-split", {"use_wandb": True, "wandb_mode": "offline", "wandb_project": "relay-test",
                                         "wandb_group": "g", "wandb_run_name": "r1", "run_dir": str(tmp_path)})
    trackers = Trackers(cfg, str(tmp_path))
    run = trackers.wandb
    log = MetricsLog(str(tmp_path), 2, out=open("/dev/null", "w"), trackers=trackers)
    for record in RECORDS:
        log.write(record)
    assert run.offline and run.project == "relay-test" and run.group == "g" and run.name == "r1"
    assert run.config["lr"] == cfg.lr and run.config["rm_type"] == cfg.rm_type  # the resolved config
    assert run.summary["reward/mean"] == 0.75 and run.summary["train/loss"] == 1.0
    log.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # the run's files under RUN_DIR


@pytest.mark.parametrize("flag,module", [("use_wandb", "wandb"), ("use_tensorboard", "tensorboard")])
def test_a_tracker_whose_package_is_missing_is_refused_before_the_job_starts(monkeypatch, flag, module):
    monkeypatch.setitem(sys.modules, module, None)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    cfg = load_config("tiny-cpu-split", {flag: True})
    needs = rf"--{flag.replace('_', '-')} needs the {module} package.*relay-rl\[trackers\]"
    with pytest.raises(ConfigError, match=needs):
        check_job(cfg)
