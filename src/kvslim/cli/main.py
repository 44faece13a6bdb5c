"""`kvslim` command line: one sub-command per job. Each command module exposes `register(sub)`,
which adds its parsers and sets `func`. User errors print one line and exit 2, no traceback."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib.metadata import entry_points

# torch's OpenMP threads spin while they wait for work (libgomp: 300,000 turns, then sleep).
# When another process holds a core, a spinning thread and the one it waits for take turns on
# it and a decode step slows two to five times; sleeping at once (OMP_WAIT_POLICY=PASSIVE)
# costs a quarter of batched throughput on idle cores instead. A short spin keeps both
# (benchmarks/shared_cores.py). OpenMP reads this once, when torch loads, so it is set before
# any command imports torch, and only when the user has chosen no waiting policy.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from kvslim.errors import KvslimError

COMMAND_MODULES = ["train_cmds", "model_cmds", "generate_cmds", "demo_cmds", "surgery_cmds",
                   "quantize_cmds", "serve_cmds", "memory_cmds", "kv_plan_cmds", "drafter_cmds",
                   "prune_cmds"]
# Commands another package adds (entry points of this group, each a module with `register`):
# the lab's benchmarks and experiments. Without it, each answers how to install it.
PLUGIN_GROUP = "kvslim.commands"
LAB_COMMANDS = {"bench": "benchmarks", "experiment": "reproducible experiments"}
LAB_INSTALL = "pip install -e ./lab (from a kvslim checkout)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvslim", description="LLM inference toolkit for when the KV cache is the wall.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"kvslim.cli.{name}").register(sub)
    added = set()
    for entry in entry_points(group=PLUGIN_GROUP):
        try:
            module = importlib.import_module(entry.value)
        except ImportError:          # a broken plugin costs its commands, not the others
            continue
        module.register(sub)
        added.add(entry.name)
    for name, what in LAB_COMMANDS.items():
        if name not in added:
            p = sub.add_parser(name, help=f"{what} (the lab package: {LAB_INSTALL})")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(func=_lab_missing)
    return parser


def _lab_missing(args) -> int:
    raise KvslimError(f"'kvslim {args.command}' comes with the lab package, kvslim-lab, which "
                      f"is not installed: {LAB_INSTALL}")


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
