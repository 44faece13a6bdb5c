"""`kvslim bench report`: the one command that regenerates docs/benchmarks.md (+ its JSON and
PNGs): the peers run (`kvslim bench peers`' flags) and what the goals need beside it."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from kvslim_lab.cli.bench_peers_cmds import add_peers_args, peers_settings, set_threads


def register_report(kinds) -> None:
    from kvslim_lab.bench.report.plan import PARTS
    p = kinds.add_parser("report", help="regenerate docs/benchmarks.md: the peers run, the "
                                        "compiled step, profiles, start-up, the goals")
    p.add_argument("--out", default="docs/benchmarks.md",
                   help="the page; its JSON beside it, its PNGs under its folder's img/")
    p.add_argument("--ref-model", default="models/ref-mha",
                   help="the reference model: batch-1 decode against llama.cpp, and the MHA "
                        "model of the capacity check")
    p.add_argument("--quick", action="store_true",
                   help="a small plan (smoke test): one round of a few short prompts")
    p.add_argument("--skip", default=None,
                   help=f"comma list of parts to leave out: {', '.join(PARTS)}")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="re-render the page (and its JSON and PNGs) from a saved report JSON, "
                        "without measuring")
    add_peers_args(p, with_defaults=False)
    p.add_argument("--json", action="store_true", help="print the report's JSON")
    p.set_defaults(func=run_report_cmd)


def run_report_cmd(args) -> int:
    from kvslim_lab.bench.report import plan
    from kvslim_lab.bench.report.measure import run_report
    from kvslim_lab.bench.report.render import load, write_page
    out = Path(args.out)
    if args.from_json:
        d = load(Path(args.from_json))
    else:
        skip = plan.parse_skip(args.skip)
        settings = peers_settings(args, **(plan.QUICK_PEERS if args.quick else {}))
        settings.names                               # unknown names fail before any work
        command = "kvslim " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        d = run_report(out, settings, plan.QUICK if args.quick else plan.FULL,
                       Path(args.ref_model), skip, set_threads(args), command,
                       show_progress=not args.json)
    write_page(d, out)
    print(json.dumps(d, indent=2) if args.json else f"wrote {out}, {out.with_suffix('.json')} "
          f"and its images under {out.parent / 'img'}")
    return 0
