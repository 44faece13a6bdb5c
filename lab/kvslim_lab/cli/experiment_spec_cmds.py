"""`kvslim experiment speculative`: speculative decoding measured -> docs/speculative.md."""
from __future__ import annotations

import json
import sys


def register_speculative(esub) -> None:
    g = esub.add_parser("speculative", help="speculative decoding (n-gram, lookahead, draft "
                                            "models) vs plain decoding at batch 1/8/32, two "
                                            "workloads; writes docs/speculative.md")
    g.add_argument("--ref-model", default="models/ref-mha", help="'' to skip")
    g.add_argument("--ref-draft", default="models/ref-mha-draft")
    g.add_argument("--skip-smollm2", action="store_true")
    g.add_argument("--drafters", nargs="*", default=[], metavar="DIR",
                   help="SmolLM2 drafters made by kvslim train-drafter (Medusa or EAGLE), "
                        "measured beside the other proposers")
    g.add_argument("--gemma3", default="", metavar="MODEL",
                   help="also Gemma 3 (e.g. gemma3-270m, a base model: plain prompts) with "
                        "n-gram and --gemma3-drafters; '' (default) skips it")
    g.add_argument("--gemma3-drafters", nargs="*", default=[], metavar="DIR",
                   help="Gemma 3 drafters made by kvslim train-drafter")
    g.add_argument("--drafter-tree", default="", metavar="JSON",
                   help="also each drafter with this tree of candidates, e.g. '[[0], [1]]' "
                        "(benchmarks/tree_shape.py measures which)")
    g.add_argument("--lookahead", default="{}", metavar="JSON",
                   help="the lookahead arm's options (window, ngram, guesses; '{}': the "
                        "defaults), measured beside n-gram on every target; '' skips it")
    g.add_argument("--only", nargs="*", default=None, metavar="LABEL",
                   help="measure only these proposers of each target (e.g. ngram lookahead); "
                        "with another --work-dir and --report, a study of a few arms that "
                        "leaves the full one's report alone")
    g.add_argument("--test", default="../shared/corpus/test.txt")
    g.add_argument("--calib", default="../shared/corpus/train.txt",
                   help="calibration text for SmolLM2's MQA conversion")
    g.add_argument("--work-dir", default="runs/speculative")
    g.add_argument("--report", default="docs/speculative.md")
    g.add_argument("--batches", default="1,8,32")
    g.add_argument("--num-speculative-tokens", type=int, default=4)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--repeats", type=int, default=2)
    g.add_argument("--adaptive", default="{}",
                   help="speculative options of the adaptive arm over the measured thresholds "
                        "(JSON), e.g. '{\"backoff_window\": 32}'")
    g.add_argument("--report-only", action="store_true")
    g.add_argument("--fresh", action="store_true",
                   help="measure every target again (else a target complete in WORK_DIR's "
                        "results.json under the same settings is kept)")
    g.add_argument("--threads", type=int)
    g.add_argument("--json", action="store_true", help="print the summary as JSON")
    g.set_defaults(func=run_speculative)


def _targets(args, work_dir):
    from pathlib import Path

    from kvslim_lab.experiments.speculative.records import Target
    from kvslim_lab.experiments.speculative.study import smollm2_variants
    k = args.num_speculative_tokens
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    modelless = {"ngram": ngram}       # the proposers every target gets: no model of their own
    if args.lookahead:
        modelless["lookahead"] = {"method": "lookahead", "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 4, **json.loads(args.lookahead)}
    targets = []
    if args.ref_model:
        proposers = dict(modelless)
        if args.ref_draft and Path(args.ref_draft).is_dir():
            proposers["ref-mha-draft"] = {"method": "draft", "model": args.ref_draft,
                                          "num_speculative_tokens": k}
        targets.append(Target("ref-mha", args.ref_model, proposers))
    if not args.skip_smollm2:
        copies = {"4-bit self": "q4", "MQA self": "mqa"}      # built only when measured
        copies = {label: c for label, c in copies.items()
                  if args.only is None or label in args.only}
        dirs = smollm2_variants(Path(work_dir), args.calib, show_progress=not args.json,
                                copies=tuple(copies.values()))
        draft = {"method": "draft", "num_speculative_tokens": k}
        proposers = {**modelless, **{label: {**draft, "model": str(dirs[c])}
                                     for label, c in copies.items()}}
        proposers.update(_drafters(args.drafters, k, args.drafter_tree))
        targets.append(Target("SmolLM2-135M", str(dirs["f32"]), proposers, chat=True))
    if args.gemma3:
        proposers = {**modelless, **_drafters(args.gemma3_drafters, k, args.drafter_tree)}
        targets.append(Target("Gemma-3-270M", args.gemma3, proposers))
    if args.only is not None:
        for target in targets:
            target.proposers = {label: spec for label, spec in target.proposers.items()
                                if label in args.only}
    return targets


def _drafters(paths: list[str], k: int, tree) -> dict[str, dict]:
    """Each learned drafter's proposer (its chain of at most k tokens), and with `tree` also
    the same drafter verifying that tree."""
    from pathlib import Path

    from kvslim.drafters.kind import drafter_kind
    out = {}
    for path in paths:
        kind = drafter_kind(path)
        heads = json.loads((Path(path) / "config.json").read_text()).get("medusa_num_heads")
        out[f"{kind} {Path(path).name}"] = {"method": kind, "model": path,
                                            "num_speculative_tokens": min(k, heads or k)}
        if tree:
            out[f"{kind} {Path(path).name} tree"] = {"method": kind, "model": path,
                                                     "tree": tree}
    return out


def _machine() -> str:
    from kvslim_lab.bench.machine import machine_info
    m = machine_info()
    return (f"{m.cpu}, {m.cores} cores, {m.memory_gib} GiB, torch {m.torch}, "
            f"{m.torch_threads} threads")


def run_speculative(args) -> int:
    from pathlib import Path

    import torch

    from kvslim_lab.cli.report_command import report_args
    from kvslim.errors import KvslimError
    from kvslim_lab.experiments.speculative.records import SpecExperimentConfig
    from kvslim_lab.experiments.speculative.report import goal_checks, write_report
    from kvslim_lab.experiments.speculative.study import SpecExperiment
    from kvslim_lab.experiments.speculative.thresholds import cells
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        adaptive = json.loads(args.adaptive)
        args.drafter_tree = json.loads(args.drafter_tree) if args.drafter_tree else None
        json.loads(args.lookahead or "{}")
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError as e:
        raise KvslimError(f"--adaptive, --drafter-tree and --lookahead must be JSON and "
                          f"--batches integers: {e}") from None
    cfg = SpecExperimentConfig(_targets(args, args.work_dir), args.test, args.work_dir,
                               batches, args.max_tokens, repeats=args.repeats, adaptive=adaptive)
    exp = SpecExperiment(cfg, show_progress=not args.json)
    if args.report_only:
        exp.reload()
    else:
        kept = exp.run(resume=not args.fresh)
        if kept and not args.json:
            print(f"kept from {exp.results_path} (complete, same settings): {', '.join(kept)}; "
                  f"--fresh measures them again")
    # The command that measures: a --report-only rewrite names the run it reports.
    command = "kvslim " + " ".join(report_args(sys.argv[1:], drop=()))
    report = write_report(exp, Path(args.report), command, _machine())
    table = cells(exp.runs)
    checks = goal_checks(exp, table)
    if args.json:
        print(json.dumps({"report": str(report), "thresholds": exp.thresholds,
                          "goals": [dict(goal=t, ok=ok, measured=d) for t, ok, d in checks]},
                         indent=1))
        return 0
    for text, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text} — {detail}")
    print(f"wrote {report}")
    return 0
