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
    g.add_argument("--ppl-max-tokens", type=int, default=None)
    g.add_argument("--skip-smollm2", action="store_true")
    g.add_argument("--smollm2-steps", type=int, default=100)
    g.add_argument("--report-only", action="store_true",
                   help="rewrite the report from results.json without running anything")
    g.add_argument("--threads", type=int)
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=run_gqa)


def run_gqa(args) -> int:
    import torch

    from kvslim.surgery.experiment import Experiment, ExperimentConfig
    from kvslim.surgery.experiment_report import goal_checks, write_report
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ExperimentConfig(model=args.model, train=args.train, valid=args.valid, test=args.test,
                           work_dir=args.work_dir, report=args.report,
                           original_steps=args.original_steps, uptrain_lr=args.uptrain_lr,
                           ppl_max_tokens=args.ppl_max_tokens, smollm2=not args.skip_smollm2,
                           smollm2_steps=args.smollm2_steps)
    exp = Experiment(cfg, show_progress=not args.quiet)
    if not args.report_only:
        exp.run()
    command = "kvslim " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "--report-only")
    report = write_report(exp, command)
    for text, ok, detail in goal_checks(exp):
        print(f"{'PASS' if ok else 'FAIL'}: {text} — {detail}")
    print(f"wrote {report}")
    return 0
