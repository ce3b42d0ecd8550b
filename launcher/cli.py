"""The ``relay`` command line: version, demo, plan, train, sft, plot, sbatch, judge, judge eval, make-model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import textwrap

import relay
from reward.settings import settings as reward_settings


def _version(_: argparse.Namespace) -> int:

    print(f"relay {relay.__version__}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.runtime:
        from launcher.relay_demo import run_relay_demo

        return run_relay_demo(procs=args.procs)
    from launcher.demo import run_demo

    return run_demo(fresh=args.fresh, steps=args.steps, arch=args.arch)


def _plan(args: argparse.Namespace) -> int:
    from launcher.allocator import make_plan, render_plan
    from launcher.config import ConfigError, load_config
    from launcher.config.checks import check_job

    try:
        cfg = load_config(args.config, args.overrides)
        check_job(cfg, sft=args.sft)
    except ConfigError as e:
        print(f"relay plan: {e}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(cfg, train_only=args.sft)
    except ConfigError as e:
        print(f"relay plan: invalid layout:\n{e}", file=sys.stderr)
        return 2
    print(render_plan(plan))
    return 0


def _job_config(args: argparse.Namespace, prog: str, sft: bool = False):
    """The job's config from ``--config`` and the config flags, checked as a start checks it
    (after the package versions); None when something is wrong (printed with ``prog``)."""
    from launcher.config import ConfigError, load_config
    from launcher.config.checks import check_job
    from launcher.job import versions_ok

    if not versions_ok(prog):
        return None
    try:
        cfg = load_config(args.config, args.overrides)
        check_job(cfg, sft=sft)  # before any process starts: a bad hook fails here, not after start-up
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None
    os.environ["RELAY_LOG_LEVEL"] = cfg.log_level  # this process and every one the job starts
    relay.configure_logging(cfg.log_level)
    return cfg


def _train(args: argparse.Namespace) -> int:
    from launcher.job import run_job
    from launcher.supervisor import GENERATION_ENV, supervise

    if args.dry_run:
        return _dry_run(args)
    cfg = _job_config(args, "relay train")
    if cfg is None:
        return 2
    if args.print_config:
        from launcher.config.loading import config_yaml

        print(config_yaml(cfg), end="")
        return 0
    if cfg.fault_tolerant and GENERATION_ENV not in os.environ:  # not already the supervised job itself
        argv = ([a for path in args.config or [] for a in ("--config", path)]
                + (["--hold", str(args.hold)] if args.hold else []) + args.overrides)
        return supervise(argv, cfg.run_dir, cfg.max_global_restart, resume=cfg.resume)
    return run_job(cfg, prog="relay train", single_node=True, hold=args.hold)


def torchrun_main(argv: list[str]) -> int:
    """``python -m launcher [--sft] --config X.yaml [--hold S] [--flag value ...]`` under torchrun:
    ``relay train``'s arguments (``--sft``: ``relay sft``'s job), run on every rank."""
    from launcher.job import run_job

    sft = "--sft" in argv
    args, rest = build_parser().parse_known_args(["train", *(a for a in argv if a != "--sft")])
    args.overrides = rest
    cfg = _job_config(args, "python -m launcher", sft=sft)
    if cfg is None:
        return 2
    return run_job(cfg, prog="python -m launcher", single_node=False, hold=args.hold, sft=sft)


def _dry_run(args: argparse.Namespace) -> int:
    from launcher.allocator import PlanError
    from launcher.config import ConfigError, load_config
    from launcher.config.checks import check_job
    from launcher.dry_run import dry_run

    try:
        cfg = load_config(args.config, args.overrides)
        check_job(cfg)
        print("\n".join(dry_run(cfg)))
    except PlanError as e:
        print(f"relay train --dry-run: invalid layout:\n{e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"relay train --dry-run: {e}", file=sys.stderr)
        return 2
    return 0


def _sft(args: argparse.Namespace) -> int:
    from launcher.job import run_job

    cfg = _job_config(args, "relay sft", sft=True)
    if cfg is None:
        return 2
    return run_job(cfg, prog="relay sft", single_node=True, sft=True)


def _plot(args: argparse.Namespace) -> int:
    from launcher.metrics import plot

    skipped: list[int] = []
    try:
        paths = plot(args.run_dir, skipped)
    except FileNotFoundError as e:
        print(f"relay plot: {e}", file=sys.stderr)
        return 2
    if skipped:
        lines = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
        print(f"relay plot: warning: left out {len(skipped)} line(s) of its metrics file that are not a metrics "
              f"record (line {lines}; a job killed while writing leaves half a line)", file=sys.stderr)
    for p in paths:
        print(f"wrote {p}")
    if not paths:
        print(f"relay plot: nothing to plot: {args.run_dir} has no step with a value to draw", file=sys.stderr)
    return 0


def _sbatch(args: argparse.Namespace) -> int:
    from launcher.allocator import PlanError, make_plan
    from launcher.config import ConfigError, load_config, parse_overrides
    from launcher.config.checks import check_job
    from launcher.sbatch import render_sbatch

    try:
        if "nnodes" in parse_overrides(args.overrides):
            raise ConfigError("relay sbatch sets --nnodes from --nodes; remove --nnodes")
        cfg = load_config(args.config, args.overrides)  # fail here, not on the cluster
        check_job(cfg)
        gpus = cfg.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
        try:  # the plan the job will make: the config with the nodes and GPUs the script passes
            make_plan(
                load_config(args.config, [*args.overrides, "--nnodes", str(args.nodes), "--gpus-per-node", str(gpus)])
            )
        except PlanError as e:
            raise ConfigError(f"invalid layout on {args.nodes} node(s) x {gpus} GPUs:\n{e}") from None
        script = render_sbatch(
            args.config,
            args.nodes,
            gpus,
            args.overrides,
            device=cfg.device,
            partition=args.partition,
            time=args.time,
            job_name=args.job_name,
            port=args.port,
            log_dir=args.log_dir,
            signal_grace=args.signal_grace,
            max_restarts=cfg.max_global_restart if cfg.fault_tolerant else 0,  # torchrun restarts the job
        )
    except (ConfigError, ValueError) as e:
        print(f"relay sbatch: {e}", file=sys.stderr)
        return 2
    os.makedirs(os.path.abspath(args.log_dir), exist_ok=True)  # slurm does not create --output's directory
    if args.output == "-":
        sys.stdout.write(script)
    else:
        with open(args.output, "w") as f:
            f.write(script)
        print(f"wrote {args.output}; submit it with: sbatch {args.output}")
    return 0


def int_at_least(lowest: int, highest: int | None = None, what: str = "an integer"):
    """An argparse type: an integer from ``lowest`` (to ``highest``), else an error naming the range."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if n < lowest or (highest is not None and n > highest):
            bounds = f"{lowest}-{highest}" if highest is not None else f">= {lowest}"
            raise argparse.ArgumentTypeError(f"{n} is out of range: use {bounds}")
        return n

    return parse


def port_number(lowest: int):
    """An argparse type: a TCP port from ``lowest`` to 65535 (a bigger number would wrap)."""
    return int_at_least(lowest, 65535, "a port number")


def _make_model(args: argparse.Namespace) -> int:
    import functools

    from engines.models.model_builder import make_model

    if args.layers is not None and args.layers < 1:
        print(f"relay make-model: --layers must be at least 1, got {args.layers}", file=sys.stderr)
        return 2
    if args.fp8_block < 0:
        print(f"relay make-model: --fp8-block must be 0 (off) or a block size, got {args.fp8_block}", file=sys.stderr)
        return 2
    if args.layers is not None:
        make_model = functools.partial(make_model, num_hidden_layers=args.layers)
    try:
        os.makedirs(args.out, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        print(f"relay make-model: cannot write to --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    if args.fp8_block:
        import tempfile

        from engines.models.checkpoint import quantize_fp8

        with tempfile.TemporaryDirectory() as full:
            make_model(args.arch, args.size, full, seed=args.seed, dtype=args.dtype)
            path = quantize_fp8(full, args.out, (args.fp8_block, args.fp8_block))
        print(f"wrote a random-weight {args.arch} ({args.size}) checkpoint, its projection weights block-FP8 "
              f"({args.fp8_block}x{args.fp8_block} blocks), to {path}")
        return 0
    path = make_model(args.arch, args.size, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote a random-weight {args.arch} ({args.size}) checkpoint to {path}")
    return 0


def _judge(args: argparse.Namespace) -> int:
    import asyncio

    from launcher.config import ConfigError, load_config
    from launcher.job import versions_ok
    from launcher.serve_judge import run_judge

    if not versions_ok("relay judge"):
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.engine == "torch":  # what the built-in engine makes of each judge's engine_config, as relay train
            from launcher.config.checks import check_builtin_engine_config

            check_builtin_engine_config(cfg)
    except ConfigError as e:
        print(f"relay judge: {e}", file=sys.stderr)
        return 2
    os.environ["RELAY_LOG_LEVEL"] = cfg.log_level  # the judge's processes too
    relay.configure_logging(cfg.log_level)
    from launcher.job import install_uvloop

    token = args.token
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.readline().strip()
        except OSError as e:
            print(f"relay judge: cannot read --token-file {args.token_file}: {e.strerror}", file=sys.stderr)
            return 2
        if not token:
            print(f"relay judge: --token-file {args.token_file} is empty", file=sys.stderr)
            return 2
    elif token and any(a == "--token" or a.startswith("--token=") for a in sys.argv):
        print(
            "relay judge: warning: --token is visible to every user of this machine in ps; "
            "use RELAY_GENRM_TOKEN or --token-file instead",
            file=sys.stderr,
        )
    install_uvloop()
    return asyncio.run(run_judge(cfg, args.host, args.port, token))


def config_flags_help(width: int = 100, topics: tuple[str, ...] | None = None) -> str:
    """Every config key as its flag, with its help, allowed values and default (from
    ``launcher/config/schema.py``), grouped by topic (``topics``: only those; default all), for
    the epilog of the subcommands that take config flags."""
    from launcher.config import FIELDS
    from launcher.config.schema import TOPICS

    metavars = {"bool": "[true|false]", "int": "INT", "float": "FLOAT", "dict": "JSON", "str": "TEXT"}
    lines = [
        "config flags (any YAML key; precedence: defaults < --config YAML < flags; booleans may be bare,",
        "JSON-valued keys take JSON):",
    ]
    for topic, names in TOPICS.items():
        if topics is None or topic in topics:
            lines += ["", f"{topic}:"] + [line for name in names for line in _flag_help(name, FIELDS[name], metavars,
                                                                                          width)]
    return "\n".join(lines)


def _flag_help(name: str, f, metavars: dict, width: int) -> list[str]:
    """One flag's help lines: its name and value kind, then its help, allowed values and default."""
    lines = []
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    shown = (
        "unset"
        if default is None
        else json.dumps(default)
        if isinstance(default, (bool, dict, list))
        else str(default)
    )
    text = f.metadata.get("help", "")
    choices = [c for c in (f.metadata.get("choices") or ()) if c is not None]
    if choices:
        text += f" (one of: {', '.join(map(str, choices))})"
    if f.metadata.get("min") is not None:
        text += f" (>= {f.metadata['min']:g})"
    if f.metadata.get("max") is not None:
        text += f" (<= {f.metadata['max']:g})"
    text += f" [default: {shown}]"
    kind = str(f.type).replace(" | None", "").replace("Optional[", "").rstrip("]")
    lines.append(f"  --{name.replace('_', '-')} {metavars.get(kind, 'VALUE')}")
    lines.extend(textwrap.wrap(text, width=width, initial_indent=" " * 8, subsequent_indent=" " * 8,
                               break_on_hyphens=False))  # a flag name stays whole
    return lines


#: the config topics each subcommand's help shows (None: every topic)
COMMAND_TOPICS = {"sft": ("layout and hardware", "optimizer", "data and model"),
                  "judge": ("layout and hardware", "GenRM (the judge)", "rewards"),
                  "judge-eval": ("layout and hardware", "GenRM (the judge)", "rewards")}


def _config_command(sub, name: str, help: str, description: str = "") -> argparse.ArgumentParser:
    """A subcommand that takes config flags: its help lists those of its topics, by topic."""
    return sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(description or help, 100),
        epilog=config_flags_help(topics=COMMAND_TOPICS.get(name)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relay",
        description="GRPO post-training with an LLM judge (GenRM) over a Monarch-style ZeroMQ actor runtime.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    v = sub.add_parser("version", help="print the version")
    v.set_defaults(func=_version)
    _add_demo(sub)
    _add_job_commands(sub)
    pt = sub.add_parser("plot", help="write PNG curves (reward, accuracy, eval, phase times) of a run directory")
    pt.add_argument("run_dir", help="the run directory (--run-dir of the job)")
    pt.set_defaults(func=_plot)
    _add_sbatch(sub)
    _add_judge(sub)
    _add_judge_eval(sub)
    _add_make_model(sub)
    _add_export_hf(sub)
    return p


def _add_demo(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="the main demo: a tiny judge and policy, then GRPO with the judge through the whole stack (CPU, minutes)",
    )
    d.add_argument("--fresh", action="store_true", help="rebuild everything (the trained judge is cached otherwise)")
    d.add_argument("--steps", type=int_at_least(1), help="GRPO steps (default: the demo-grpo config's num_rollout, 60)")
    from .demo import DEMO_ARCHS

    d.add_argument("--arch", default="qwen3", choices=DEMO_ARCHS,
                   help="the policy's and judge's architecture (qwen3_moe: tiny mixture-of-experts models; "
                        "qwen3_5_moe: tiny Qwen3.5 hybrids, Gated DeltaNet + gated attention + MoE; each demo lives in "
                        "$RELAY_CACHE/<arch>/demo)")
    d.add_argument(
        "--runtime",
        action="store_true",
        help="instead: a short tour of the relay runtime (process mesh, errors, failures)",
    )
    d.add_argument("--procs", type=int_at_least(2, 64), default=4,
                   help="--runtime: number of worker processes, 2-64 (default 4)")
    d.set_defaults(func=_demo)


def _add_job_commands(sub) -> None:
    """plan, train and sft: a config and its flags."""
    pl = _config_command(
        sub,
        "plan",
        help="print the GPU-bundle plan of a config (exit 2 with the error if the layout is invalid)",
        description="Print the plan: bundle -> node/GPU -> roles and judge instances, phases, memory "
        "fractions. Any config key can be overridden with its flag, e.g. --resource '{...}' --colocate.",
    )
    pl.add_argument("--config", action="append", help="YAML config (a path, or a name in torchrun_configs/); "
                    "several are layered in order, a later file's keys over an earlier's")
    pl.add_argument("--sft", action="store_true", help="the placement of relay sft (the actor's GPUs only)")
    pl.set_defaults(func=_plan, takes_overrides=True)
    tr = _config_command(
        sub,
        "train",
        help="run a job on this machine (one node) without typing torchrun",
        description="Start the controller and this node's agent and workers, report the placement, then run "
        "GRPO when the config has --prompt-data (otherwise only place the job and stop). With --use-fault-tolerance, "
        "the job runs as a child of this command, which restarts it from its last checkpoint after a failure, at most "
        "--max-global-restart times (docs/failures.md).",
    )
    tr.add_argument("--config", action="append", help="YAML config (a path, or a name in torchrun_configs/); "
                    "several are layered in order, a later file's keys over an earlier's")
    tr.add_argument("--hold", type=float, default=0.0, help="keep the placed job up this many seconds")
    tr.add_argument("--dry-run", action="store_true", help="check everything a start checks (config, layout and "
                    "memory fit, data files, user code, models) and start nothing")
    tr.add_argument("--print-config", action="store_true",
                    help="print the resolved config (what RUN_DIR/config.yaml will hold) and start nothing")
    tr.set_defaults(func=_train, takes_overrides=True)
    st = _config_command(
        sub,
        "sft",
        help="supervised fine-tuning (cross-entropy on response tokens) with the same trainer",
        description="Train on JSONL rows {prompt, response} (--prompt-data), --sft-steps steps of --global-batch-size "
                    "rows; "
        "held-out exact-match accuracy on --eval-prompt-data; writes an HF checkpoint to --save-hf.",
    )
    st.add_argument("--config", action="append", help="YAML config (a path, or a name in torchrun_configs/); "
                    "several are layered in order, a later file's keys over an earlier's")
    st.set_defaults(func=_sft, takes_overrides=True)


def _add_sbatch(sub) -> None:
    sb = _config_command(
        sub,
        "sbatch",
        help="write a slurm script that runs the job with one torchrun per node",
        description="Write a slurm script that runs the job's torchrun on every node. Config flags after "
        "the options below go into the script (--gpus-per-node here is the slurm request and also "
        "the job's).",
    )
    sb.add_argument("--config", required=True, help="YAML config")
    sb.add_argument("--nodes", type=int_at_least(1), required=True, help="number of nodes")
    sb.add_argument("--partition", help="slurm partition")
    sb.add_argument("--time", help="time limit, e.g. 24:00:00")
    sb.add_argument(
        "--gpus-per-node",
        type=int_at_least(1),
        help="GPUs per node to request and use (default: the config's gpus_per_node, 8)",
    )
    sb.add_argument("--job-name", default="relay", help="slurm job name")
    sb.add_argument(
        "--port",
        type=port_number(1),
        help="rendezvous port on the head node (default: a free one from 20000 + job id %% 10000)",
    )
    sb.add_argument(
        "--log-dir",
        default="logs",
        help="batch and per-node logs, on a filesystem all nodes share (default: logs; created now)",
    )
    sb.add_argument(
        "--signal-grace",
        type=int_at_least(0),
        default=300,
        help="seconds before the time limit at which slurm sends SIGTERM so the job checkpoints and requeues (default "
             "300; 0: none)",
    )
    sb.add_argument("--output", "-o", default="-", help="where to write the script (default: stdout)")
    sb.set_defaults(func=_sbatch, takes_overrides=True)


def _add_judge(sub) -> None:
    jd = _config_command(
        sub,
        "judge",
        help="run only the judge (engines + HTTP gateway) until Ctrl-C",
        description="Run only the judge of a config: its engines and the judge service with the HTTP "
        "gateway, until SIGINT/SIGTERM. Config flags override the judge's keys (--genrm-*).",
    )
    jd.add_argument("--config", required=True, help="YAML config with a GenRM judge")
    jd.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    jd.add_argument("--port", type=port_number(0), default=8000, help="port (default 8000; 0: any free port)")
    jd.add_argument(
        "--token",
        default=reward_settings().genrm_token or None,
        help="require 'Authorization: Bearer TOKEN' on every route (default: $RELAY_GENRM_TOKEN; "
        "a token given here is visible to other users in ps: prefer the variable or --token-file)",
    )
    jd.add_argument("--token-file", default=None, help="read the bearer token from this file (its first line)")
    jd.set_defaults(func=_judge, takes_overrides=True)


def _add_judge_eval(sub) -> None:
    ev = _config_command(
        sub,
        "judge-eval",
        help="score a judge on labelled pairs before training (relay judge eval ...)",
        description="Score the config's judge on labelled pairs (--data: the --genrm-self-check-data format) "
        "through exactly the training reward's path: agreement, confusion matrix, parse failures, latency, the "
        "cases it got wrong. --compare scores a second side (more config flags: another judge, template or "
        "sampling config) on the same pairs in the same run.",
    )
    ev.add_argument("--config", action="append", required=True, help="YAML config with a GenRM judge (layered)")
    ev.add_argument("--data", required=True, help="JSONL pairs {question?, label, response, expected (1 or 0)}")
    ev.add_argument("--compare", default=None, metavar="FLAGS",
                    help="config flags of the second side, one string (e.g. \"--genrm-parse strict\")")
    ev.add_argument("--out", default="runs/judge-eval", help="where eval.json and the wrong cases go")
    ev.set_defaults(func=_judge_eval, takes_overrides=True)


def _judge_eval(args: argparse.Namespace) -> int:
    import asyncio

    from launcher.config import ConfigError
    from launcher.job import install_uvloop, versions_ok
    from launcher.judge_eval import run_eval

    if not versions_ok("relay judge eval"):
        return 2
    install_uvloop()
    try:
        return asyncio.run(run_eval(args.config, args.overrides, args.data, args.compare, args.out))
    except ConfigError as e:
        print(f"relay judge eval: {e}", file=sys.stderr)
        return 2


def _add_make_model(sub) -> None:
    mm = sub.add_parser(
        "make-model", help="write a random-weight HF checkpoint (config, safetensors, tokenizer, chat template)"
    )
    mm.add_argument("--arch", default="qwen3",
                    choices=("qwen3", "qwen2", "llama", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe"))
    mm.add_argument(
        "--size",
        default="tiny",
        choices=("tiny", "small", "0.6b", "4b", "30b-a3b", "35b-a3b"),
        help="tiny/small for CPU; 0.6b/4b copy Qwen3 shapes (dense archs), 30b-a3b Qwen3-30B-A3B's (qwen3_moe, "
             "qwen3_vl_moe), 35b-a3b Qwen3.5-35B-A3B's (qwen3_5_moe)",
    )
    mm.add_argument("--layers", type=int, default=None, metavar="N",
                    help="this many decoder layers instead of the size's (a reduced-depth copy of a large shape)")
    mm.add_argument("--out", required=True, help="output directory")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--fp8-block", type=int, default=0, metavar="N",
                    help="store the projection weights block-quantized to FP8 e4m3 in NxN blocks, as large FP8 judges "
                         "ship (the real ones use 128)")
    mm.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    mm.set_defaults(func=_make_model)


def _add_export_hf(sub) -> None:
    ex = sub.add_parser(
        "export-hf", help="write a trainer checkpoint as an HF checkpoint (config, safetensors, tokenizer)",
        description="Write a trainer checkpoint (RUN_DIR/checkpoints/step_NNNNNN, any TP/DP/EP layout) as an HF "
                    "checkpoint that transformers loads: the weights under HF names beside the config, tokenizer "
                    "and chat template the checkpoint keeps. Runs on CPU in this process.")
    ex.add_argument("checkpoint", metavar="CKPT", help="a trainer checkpoint directory (with relay-checkpoint.json)")
    ex.add_argument("--out", required=True, help="the HF directory to write (must not exist, or be empty)")
    ex.set_defaults(func=_export_hf)


def _export_hf(args: argparse.Namespace) -> int:
    import warnings

    from engines.trainer.checkpoint_export import export_hf
    from engines.trainer.checkpoint_io import CheckpointFormatError

    try:
        with warnings.catch_warnings():  # Megatron's and torch.distributed.checkpoint's notes to developers
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
            out = export_hf(args.checkpoint, args.out)
    except CheckpointFormatError as e:
        print(f"relay export-hf: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"relay export-hf: {e}", file=sys.stderr)  # an unreadable checkpoint file, an unwritable --out
        return 2
    print(f"relay export-hf: wrote {out} (config.json, model.safetensors, tokenizer) from {args.checkpoint}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:  # every RELAY_* variable of every layer, checked before any work starts (launcher/settings.py)
        from launcher.settings import check_all

        check_all()
    except ValueError as e:
        print(f"relay: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["judge", "eval"]:  # `relay judge eval ...` is the judge-eval command
        argv = ["judge-eval", *argv[2:]]
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = rest
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from reward.rewards import use_working_directory

    # The console script starts with its own directory on sys.path, not the working one:
    # resolve --custom-rm-path and the other module.func flags as `python -m` would.
    use_working_directory()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
