"""``relay judge eval --config X --data PAIRS.jsonl [--compare "FLAGS"] [--out DIR]``: a judge
scored on a labelled set before any training, through exactly the training reward's path
(its prompt template, answer guard, sampling config and verdict parsing: ``judge_reward``).

``PAIRS.jsonl`` is the ``--genrm-self-check-data`` format: rows ``{question?, label,
response, expected}`` (expected 1: the response matches the label). Per judge instance:
agreement with ``expected``, the confusion matrix (expected 1 / 0 by verdict 1 / 0 /
unreadable), parse failures, latency per call (p50 / p95), and the cases it got wrong,
written to ``DIR/wrong-<side>-<instance>.jsonl``; everything in ``DIR/eval.json``.

``--compare`` scores a second side on the same pairs in the same run: the config with more
flags (another judge model, prompt template, parse mode or sampling config). A side whose
judge (models, engine and sampling configs) equals the first's reuses its engines; another
judge starts after the first stopped (so two large judges need not fit at once).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from launcher.config import JobConfig, load_config


def judge_spec(cfg: JobConfig) -> tuple:
    """What makes two configs' judges the same engines: each instance's model, GPUs, engine and
    sampling configs."""
    return tuple(sorted((name, inst.model_path, inst.num_gpus, inst.num_gpus_per_engine,
                         json.dumps(inst.engine_config, sort_keys=True),
                         json.dumps(inst.sampling_config, sort_keys=True)) for name, inst in cfg.genrm.items()))


def figures(results: list[dict], seconds: list[float]) -> dict:
    """Agreement, confusion matrix, parse failures and latency of one instance's results
    (``reward.integrity.run_checks`` rows) and call times."""
    confusion = {f"expected_{e}": {"verdict_1": 0, "verdict_0": 0, "unreadable": 0} for e in (1, 0)}
    for r in results:
        column = "unreadable" if r["verdict"] is None else f"verdict_{r['verdict']}"
        confusion[f"expected_{r['expected']}"][column] += 1
    ordered = sorted(seconds)
    pick = (lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)) if ordered else (lambda q: None)
    ok = sum(r["ok"] for r in results)
    return {"pairs": len(results), "agreement": round(ok / len(results), 4) if results else None, "right": ok,
            "confusion": confusion, "parse_failures": sum(r["verdict"] is None for r in results),
            "latency_p50_s": pick(0.5), "latency_p95_s": pick(0.95)}


async def score_side(cfg: JobConfig, address: str, checks: list) -> dict:
    """Every instance of ``cfg``'s judge on ``checks``: {instance: (results, call seconds)}."""
    from reward import integrity
    from reward.rewards import judge_reward

    out = {}
    for instance in cfg.genrm:
        reward = judge_reward(cfg, judge_address=address, route_key=instance)
        seconds: list[float] = []

        async def timed(sample: dict, reward=reward, seconds=seconds) -> dict:
            t0 = time.monotonic()
            try:
                return await reward(sample)
            finally:
                seconds.append(time.monotonic() - t0)

        out[instance] = (await integrity.run_checks(checks, timed), seconds)
    return out


async def run_eval(config, overrides: list[str], data: str, compare: str | None, out_dir: str, out=sys.stdout) -> int:
    """The command (see the module docstring); exit status 0, or 2 for bad input (said why)."""
    from launcher.serve_judge import start_judge
    from reward import integrity

    sides = {"A": load_config(config, overrides)}
    if compare is not None:
        sides["B"] = load_config(config, [*overrides, *shlex.split(compare)])
    for name, cfg in sides.items():
        if not cfg.genrm:
            print(f"relay judge eval: side {name}'s config has no judge (genrm_model_path or genrm_instances)",
                  file=sys.stderr)
            return 2
    try:
        checks = integrity.load_checks(data)
    except OSError as e:
        print(f"relay judge eval: --data {data}: cannot read it ({e.strerror}); give a JSONL file of pairs "
              "{question?, label, response, expected}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"relay judge eval: {e}", file=sys.stderr)
        return 2
    given = " ".join(f"--config {c}" for c in ([config] if isinstance(config, str) else config)) + (
        " " + " ".join(overrides) if overrides else "")
    print(f"relay judge eval: {len(checks)} pairs from {data}; side A: {given}"
          + (f"; side B: {given} {compare}" if compare is not None else ""), file=out, flush=True)
    scored: dict[str, dict] = {}
    running = None  # (spec, engines, service, procs)
    try:
        for name, cfg in sides.items():
            if running is None or running[0] != judge_spec(cfg):
                if running is not None:
                    await running[1].stop()
                    await running[3].stop()
                    running = None
                engines, service, procs = await start_judge(cfg)
                running = (judge_spec(cfg), engines, service, procs)
            scored[name] = await score_side(cfg, running[3].procs[0].addr, checks)
    finally:
        if running is not None:
            await running[1].stop()
            await running[3].stop()
    report = write_report(scored, out_dir)
    print_report(report, out)
    return 0


def write_report(scored: dict, out_dir: str) -> dict:
    """``DIR/eval.json`` (every side's figures per instance) and ``DIR/wrong-<side>-<instance>.jsonl``."""
    os.makedirs(out_dir, exist_ok=True)
    report: dict = {}
    for side, instances in scored.items():
        for instance, (results, seconds) in instances.items():
            wrong_path = os.path.join(out_dir, f"wrong-{side}-{instance}.jsonl")
            with open(wrong_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in results if not r["ok"])
            report.setdefault(side, {})[instance] = {**figures(results, seconds), "wrong_file": wrong_path}
    with open(os.path.join(out_dir, "eval.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def print_report(report: dict, out) -> None:
    """Side by side: one column per (side, instance)."""
    columns = [(side, instance, fig) for side, instances in report.items() for instance, fig in instances.items()]
    rows = [("", lambda f, s, i: f"{s} {i}"),
            ("agreement", lambda f, s, i: f"{f['agreement']:.3f} ({f['right']}/{f['pairs']})"),
            ("expected 1: said 1/0/?", lambda f, s, i: "/".join(str(v) for v in f["confusion"]["expected_1"].values())),
            ("expected 0: said 1/0/?", lambda f, s, i: "/".join(str(v) for v in f["confusion"]["expected_0"].values())),
            ("parse failures", lambda f, s, i: str(f["parse_failures"])),
            ("latency p50 / p95 s", lambda f, s, i: f"{f['latency_p50_s']} / {f['latency_p95_s']}"),
            ("wrong cases", lambda f, s, i: f["wrong_file"])]
    for label, cell in rows:
        print(f"{label:<24}" + "  ".join(f"{cell(f, s, i):<28}" for s, i, f in columns), file=out)
    out.flush()
