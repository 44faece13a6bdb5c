"""`kvslim train-drafter`: Medusa heads or an EAGLE head for a model, trained on its own answers."""
from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, fields


def register(sub) -> None:
    from kvslim.train.drafter import DrafterTrainConfig
    p = sub.add_parser("train-drafter", help="train Medusa heads or an EAGLE head by self-distillation")
    p.add_argument("model", help="the model (a directory, a .gguf, gemma3-270m, or 'default')")
    p.add_argument("out", help="the drafter's output directory")
    p.add_argument("--prompts", required=True, help="text file, one prompt a line")
    for f in fields(DrafterTrainConfig):
        if f.default is MISSING:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.metadata["help"])
            continue
        p.add_argument(flag, type=type(f.default), default=f.default,
                       help=f"{f.metadata['help']} (default {f.default})")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run_train_drafter)


def run_train_drafter(args) -> int:
    import torch

    from kvslim.train.drafter import DrafterTrainConfig, train_drafter
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {f.name: getattr(args, f.name) for f in fields(DrafterTrainConfig)}
    options["model"] = None if args.model == "default" else args.model
    summary = train_drafter(DrafterTrainConfig(**options), show_progress=not args.quiet)
    if args.json:
        print(json.dumps(summary["final"] | {"answer_tokens": summary["answer_tokens"]}))
    else:
        final = summary["final"]
        scores = (f"top-1 {final.get('top1')}" if args.kind == "eagle" else
                  f"top-1 per head {final.get('top1')}, top-5 {final.get('top5')}")
        print(f"wrote {args.out}: {summary['sequences']} answers, {summary['answer_tokens']} "
              f"tokens; final loss {final.get('loss')}, {scores}")
    return 0
