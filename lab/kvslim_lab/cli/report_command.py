"""The command line a study's report prints: how the work was split and shown does not change
the numbers, so those options are left out."""
from __future__ import annotations

import json
import shlex
import sys


def report_args(argv: list[str],
                 drop: tuple[str, ...] = ("--shard", "--threads")) -> list[str]:
    """The command line to print in the report: without --report-only, --json, --quiet, --fresh
    and the options in `drop` (how the work was split and shown does not change the numbers;
    the gqa experiment's perplexities do not depend on --threads either)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        if a in ("--report-only", "--json", "--quiet", "--fresh") or a.startswith(
                tuple(f"{d}=" for d in drop)):
            continue
        out.append(shlex.quote(a))
    return out


def write_study_report(exp, args, write_report, report_data, goals) -> int:
    """The end of a study's command: its report written (docs page, JSON, plot), then the JSON
    printed with --json, else each goal's line and where the report went."""
    from kvslim_lab.bench.machine import machine_info
    command = "kvslim " + " ".join(report_args(sys.argv[1:], drop=()))
    machine = machine_info().to_dict()
    report = write_report(exp, command, machine)
    if args.json:
        print(json.dumps(report_data(exp, command, machine), indent=1))
        return 0
    for g in goals(exp):
        print(g.line()[2:])
    print(f"wrote {report}")
    return 0


def run_bench_report(args, config, run, write_report, format_markdown) -> int:
    """A benchmark whose result carries its command, date and machine: `config` built from the
    flags first (bad ones fail before any model loads), `run(config, show_progress)` measured,
    the report written to --out, then its JSON (--json) or its markdown printed."""
    import time

    import torch

    from kvslim_lab.bench.machine import machine_info
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config(args)
    result = run(cfg, show_progress=not args.json)
    result.command = "kvslim " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result.date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result.machine = machine_info().to_dict()
    paths = write_report(result, args.out)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_markdown(result))
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0

