"""``relay train --dry-run``: everything a job checks before it starts a process, and what it
would start, without starting anything.

It loads the config (flags, YAML, the original's names), runs the job checks (a judge for
dapo-genrm, rewards, every ``module.func`` importable), plans the layout with its memory fit,
reads every data file as the job reads it (``--input-key`` / ``--label-key`` /
``--metadata-key``, labels where a built-in reward compares with them) and looks for each
model's ``config.json``. A model that is not on this machine is reported (a cluster job's
paths may exist only on its nodes), not refused."""

from __future__ import annotations

import os

from .allocator import make_plan, render_plan
from .config import ConfigError
from .data import DataError, Row, job_datasets, question_text


def _row_line(what: str, rows: list[Row]) -> str:
    first = rows[0]
    keys = sorted(first.metadata)
    return (f"{what}: {len(rows)} rows; row 0: question {question_text(first.prompt)[:60]!r}, label "
            f"{first.label[:30]!r}, metadata keys {keys}")


def dry_run(cfg) -> list[str]:
    """The dry run's report, one line each; ConfigError (PlanError for the layout) with what
    to change."""
    plan = make_plan(cfg)
    lines = [render_plan(plan), ""]
    if cfg.prompt_data:
        try:
            rows, evals = job_datasets(cfg)
        except DataError as e:
            raise ConfigError(str(e)) from None
        lines.append(_row_line(f"--prompt-data {cfg.prompt_data}", rows))
        lines += [_row_line(f"eval set {name!r} ({path})", eval_rows)
                  for (name, eval_rows), (_, path) in zip(evals, cfg.eval_sets)]
    else:
        lines.append("no --prompt-data: the job would place its processes and stop")
    models = [("--hf-checkpoint", cfg.hf_checkpoint)] + [(f"judge {name!r}", inst.model_path)
                                                         for name, inst in cfg.genrm.items()]
    for what, path in models:
        if path and os.path.exists(os.path.join(path, "config.json")):
            lines.append(f"{what} {path}: found")
        else:
            lines.append(f"{what} {path}: not on this machine (the job reads it on its nodes)")
    if cfg.custom_generate_function_path:
        lines.append(f"custom rollout {cfg.custom_generate_function_path}: imported")
    lines.append("dry run: nothing was started")
    return lines
