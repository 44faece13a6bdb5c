"""The command line a study's report prints: how the work was split and shown does not change
the numbers, so those options are left out."""
from __future__ import annotations

import shlex


def report_args(argv: list[str],
                 drop: tuple[str, ...] = ("--shard", "--threads")) -> list[str]:
    """The command line to print in the report: without --report-only, --json, --quiet and the
    options in `drop` (how the work was split and shown does not change the numbers; the gqa
    experiment's perplexities do not depend on --threads either)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        if a in ("--report-only", "--json", "--quiet") or a.startswith(
                tuple(f"{d}=" for d in drop)):
            continue
        out.append(shlex.quote(a))
    return out
