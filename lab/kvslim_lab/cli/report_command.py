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
