"""Per-step metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl`` (and the same
records to the trackers a config asks for: launcher/trackers.py), a one-line progress report
per step, and ``relay plot RUN_DIR``, which draws the curves as PNG files next to the metrics."""

from __future__ import annotations

import json
import math
import os
import sys
import time

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Append-only; a resumed run keeps the earlier lines (the step numbers continue)."""

    def __init__(self, run_dir: str, total_steps: int, out=sys.stdout, trackers=None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.total = total_steps
        self.out = out
        self.t0 = time.monotonic()
        self.trackers = trackers  # launcher.trackers.Trackers, or None

    def write(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)

    def progress(self, step: int, record: dict) -> None:
        """``[step/total] elapsed | key figures``, one line per step."""
        done = step + 1
        bar_len = 20
        filled = int(bar_len * done / max(1, self.total))
        bar = "#" * filled + "." * (bar_len - filled)
        keys = [
            ("reward", "reward/mean"),
            ("acc", "reward/accuracy"),
            ("eval", "eval/accuracy"),
            ("loss", "train/loss"),
            ("len", "rollout/response_len"),
            ("step_s", "time/step"),
        ]
        parts = [f"{name} {record[k]:.3g}" for name, k in keys if isinstance(record.get(k), (int, float))]
        print(
            f"[{bar}] step {done}/{self.total} {time.monotonic() - self.t0:6.1f}s | " + "  ".join(parts),
            file=self.out,
            flush=True,
        )

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()


def read_metrics(run_dir: str, skipped: list[int] | None = None) -> list[dict]:
    """The records of ``run_dir``'s metrics file. A line that is not a JSON object with a
    numeric ``step`` (a job killed while writing leaves half a line) is left out; its number
    goes to ``skipped`` when given."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir!r} a run directory (--run-dir)?")
    records = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:  # not JSON, or not UTF-8
                record = None
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
                records.append(record)
            elif skipped is not None:
                skipped.append(n)
    return records


def _figures(train: list[dict], evals: list[dict], checks: list[dict] = ()) -> list[tuple[str, str, list[tuple]]]:
    """(file, y label, [(records, key, label, line style)]) per figure. Lines that can
    coincide get distinct styles, and pass@k is drawn only when k > 1 (with k = 1 it equals
    the held-out accuracy and would hide it). ``checks``: the judge self-check records."""
    accuracy = [
        (train, "reward/accuracy", "train accuracy (reward)", {}),
        (evals, "eval/accuracy", "held-out accuracy (reward)", {"linewidth": 2.5, "zorder": 3}),
        (evals, "eval/exact_accuracy", "held-out exact match (no judge)", {"linestyle": "--", "zorder": 4}),
    ]
    named = sorted({k.split("/")[1] for r in evals for k in r if k.count("/") == 2 and k.endswith("/accuracy")})
    if len(named) > 1:  # several eval sets: one line each (the first's is also the held-out line above)
        accuracy += [(evals, f"eval/{name}/accuracy", f"held-out {name} accuracy (reward)", {"linestyle": "-."})
                     for name in named]
    if any(r.get("eval/k", 1) > 1 for r in evals):
        accuracy.append(
            (
                evals,
                "eval/pass@k",
                f"held-out pass@{max(r.get('eval/k', 1) for r in evals)}",
                {"linestyle": ":", "zorder": 2},
            )
        )
    return [
        ("reward.png", "reward", [(train, "reward/mean", "reward mean", {}), (train, "reward/std", "reward std", {})]),
        ("accuracy.png", "accuracy", accuracy),
        (
            "judge.png",
            "share",
            [
                (train, "audit/agreement", "judge agrees with the rule grader (audited)", {"linewidth": 2.5}),
                (train, "audit/rule_accuracy", "rule-graded accuracy (audited)", {"linestyle": "--"}),
                (sorted([*checks, *train], key=lambda r: r["step"]), "judge/canary_pass_rate",
                 "injection canaries held", {"linestyle": "-."}),
                (train, "judge/parse_failure_rate", "judge replies not parsed", {"linestyle": ":"}),
                (train, "audit/alarm", "drift alarm (on = 1)", {"drawstyle": "steps-post", "alpha": 0.6}),
            ],
        ),
        (
            "phases.png",
            "seconds",
            [
                (train, k, k.split("/", 1)[1], {})
                for k in ("time/rollout", "time/reward", "time/swap", "time/train", "time/sync", "time/orchestration")
            ],
        ),
    ]


def plot(run_dir: str, skipped: list[int] | None = None) -> list[str]:
    """Write reward.png, accuracy.png, judge.png and phases.png into ``run_dir`` (each one
    that has data); returns the paths. ``skipped``: as :func:`read_metrics`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir, skipped)
    train = [r for r in records if r.get("kind", "train") in ("train", "sft")]
    evals = [r for r in records if r.get("kind") == "eval"]
    written = []

    def series(rs, key):
        pts = [(r["step"], r[key]) for r in rs if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        return [p[0] for p in pts], [p[1] for p in pts]

    figures = _figures(train, evals, [r for r in records if r.get("kind") == "judge_check"])
    for name, ylabel, lines in figures:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = 0
        for rs, key, label, style in lines:
            x, y = series(rs, key)
            if x:
                ax.plot(x, y, label=label, **({"marker": "o"} if len(x) < 30 else {}), **style)
                drawn += 1
        if drawn:
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            path = os.path.join(run_dir, name)
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)
    return written
