"""Experiment trackers beside ``RUN_DIR/metrics.jsonl``, with the original's flag names:
``--use-tensorboard`` (event files under ``RUN_DIR/tb``, or ``--tensorboard-dir``) and
``--use-wandb`` (``--wandb-project``, ``--wandb-group``, ``--wandb-run-name``,
``--wandb-team``, ``--wandb-mode``; the run's files under RUN_DIR). Each gets the same
records as metrics.jsonl (their numeric values, at the record's step) and wandb the resolved
config. Their packages are optional (``pip install 'relay-rl[trackers]'``): asking for one
that is not installed is refused before the job starts (launcher/config/checks.py)."""

from __future__ import annotations

import os

from launcher.config import JobConfig


class Trackers:
    """The trackers a config asks for, open for one run in ``run_dir``."""

    def __init__(self, cfg: JobConfig, run_dir: str):
        self.tb = None
        self.wandb = None
        if cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(cfg.tensorboard_dir or os.path.join(run_dir, "tb"))
        if cfg.use_wandb:
            import wandb
            import yaml

            from launcher.config.loading import config_yaml

            self.wandb = wandb.init(project=cfg.wandb_project, group=cfg.wandb_group, name=cfg.wandb_run_name,
                                    entity=cfg.wandb_team, mode=cfg.wandb_mode, dir=run_dir,
                                    config=yaml.safe_load(config_yaml(cfg)), resume="allow" if cfg.resume else None)

    def log(self, record: dict) -> None:
        step = int(record.get("step", 0))
        values = {k: v for k, v in record.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key.replace(".", "/"), value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({**values, "kind": record.get("kind", "train")}, step=step, commit=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            wandb.teardown()  # its service process too: nothing of the run outlives the job
