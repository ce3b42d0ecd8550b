"""The ``relay`` command line. Subcommands: version, demo (later issues add train, plan,
sbatch, judge, sft, plot, make-model)."""

from __future__ import annotations

import argparse
import sys


def _version(_: argparse.Namespace) -> int:
    import relay

    print(f"relay {relay.__version__}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from launcher.demo import run_relay_demo

    return run_relay_demo(procs=args.procs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relay",
        description="GRPO post-training with an LLM judge (GenRM) over a Monarch-style ZeroMQ actor runtime.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    v = sub.add_parser("version", help="print the version")
    v.set_defaults(func=_version)
    d = sub.add_parser(
        "demo",
        help="run the main demo on this machine (for now: a relay process mesh that replies)",
    )
    d.add_argument("--procs", type=int, default=4, help="number of worker processes (default 4)")
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
