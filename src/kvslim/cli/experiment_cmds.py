"""`kvslim experiment gqa`: the GQA uptraining experiment and its report."""
from __future__ import annotations

import shlex
import sys


def register(sub) -> None:
    p = sub.add_parser("experiment", help="reproducible experiments")
    esub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    g = esub.add_parser("gqa", help="MHA -> GQA/MQA x methods x uptraining fraction, with the "
                                    "MHA control; writes docs/gqa-uptraining.md")
    g.add_argument("--model", default="models/ref-mha", help="the reference MHA model")
    g.add_argument("--train", default="../shared/corpus/train.txt")
    g.add_argument("--valid", default="../shared/corpus/valid.txt")
    g.add_argument("--test", default="../shared/corpus/test.txt")
    g.add_argument("--work-dir", default="runs/gqa", help="checkpoints and results.json")
    g.add_argument("--report", default="docs/gqa-uptraining.md")
    g.add_argument("--original-steps", type=int, help="default: from MODEL/train_log.jsonl")
    g.add_argument("--uptrain-lr", type=float, default=2e-4)
    g.add_argument("--ppl-max-tokens", type=int, default=40_000,
                   help="score the first N test tokens (0: all)")
    g.add_argument("--skip-smollm2", action="store_true")
    g.add_argument("--smollm2-steps", type=int, default=30)
    g.add_argument("--smollm2-ppl-max-tokens", type=int, default=12_000)
    g.add_argument("--shard", default="0/1", metavar="I/N",
                   help="run jobs I, I+N, ... of the plan (N processes share --work-dir)")
    g.add_argument("--report-only", action="store_true",
                   help="rewrite the report from results.json without running anything")
    g.add_argument("--threads", type=int)
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=run_gqa)
    from kvslim.cli.experiment_spec_cmds import register_speculative
    register_speculative(esub)


def run_gqa(args) -> int:
    import torch

    from kvslim.experiments.gqa import Experiment, ExperimentConfig
    from kvslim.experiments.gqa_report import goal_checks, write_report
    if args.threads:
        torch.set_num_threads(args.threads)
    shard = _parse_shard(args.shard)
    cfg = ExperimentConfig(model=args.model, train=args.train, valid=args.valid, test=args.test,
                           work_dir=args.work_dir, report=args.report,
                           original_steps=args.original_steps, uptrain_lr=args.uptrain_lr,
                           ppl_max_tokens=args.ppl_max_tokens or None,
                           smollm2=not args.skip_smollm2,
                           smollm2_steps=args.smollm2_steps,
                           smollm2_ppl_max_tokens=args.smollm2_ppl_max_tokens, shard=shard)
    exp = Experiment(cfg, show_progress=not args.quiet)
    if not args.report_only:
        exp.run()
    exp.reload()                                  # other shards may have added results
    command = "kvslim " + " ".join(_report_args(sys.argv[1:]))
    report = write_report(exp, command)
    for text, ok, detail in goal_checks(exp):
        print(f"{'PASS' if ok else 'FAIL'}: {text} — {detail}")
    print(f"wrote {report}")
    return 0


def _parse_shard(text: str) -> tuple[int, int]:
    from kvslim.errors import KvslimError
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise KvslimError(f"--shard must look like I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise KvslimError(f"--shard {text}: need 0 <= I < N")
    return i, n


def _report_args(argv: list[str]) -> list[str]:
    """The command line to print in the report: without --report-only, --shard and --threads
    (how the work was split does not change the numbers)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--shard", "--threads"):
            skip = True
            continue
        if a == "--report-only" or a.startswith(("--shard=", "--threads=")):
            continue
        out.append(shlex.quote(a))
    return out
