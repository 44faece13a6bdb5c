"""`kvslim` command line: one sub-command per job. Each command module exposes `register(sub)`,
which adds its parsers and sets `func`. User errors print one line and exit 2, no traceback."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# torch's OpenMP threads spin while they wait for work. When another process holds a core, a
# spinning thread and the one it waits for take turns on it and a decode step slows several
# times (benchmarks/shared_cores.py). PASSIVE waiters sleep instead. OpenMP reads this once,
# when torch loads, so it must be set before any command imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvslim.errors import KvslimError

COMMAND_MODULES = ["train_cmds", "model_cmds", "generate_cmds", "demo_cmds", "surgery_cmds",
                   "experiment_cmds", "serve_cmds", "memory_cmds", "bench_cmds"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvslim", description="LLM inference toolkit for when the KV cache is the wall.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"kvslim.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KvslimError as e:
        print(f"kvslim {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
