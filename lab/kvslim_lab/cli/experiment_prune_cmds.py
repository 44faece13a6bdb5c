"""`kvslim experiment prune`: magnitude, Wanda and SparseGPT against sparsity, with and without
4-bit kept weights, and recovery uptraining -> docs/pruning.md."""
from __future__ import annotations


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def register_prune(esub) -> None:
    g = esub.add_parser("prune", help="magnitude / Wanda / SparseGPT at 10-70%%, 2:4, 4:8, with "
                                      "and without 4-bit, recovery uptraining; writes "
                                      "docs/pruning.md")
    g.add_argument("--models", type=_list, default=["models/ref-mha", "smollm2"],
                   help="comma-separated: model directories, .gguf files, smollm2")
    g.add_argument("--methods", type=_list, default=["magnitude", "wanda", "sparsegpt"])
    g.add_argument("--targets", type=_list, default=["0.1", "0.3", "0.5", "0.7", "2:4", "4:8"],
                   help="fractions of each row and N:M patterns")
    g.add_argument("--quantized-targets", type=_list, default=["0.5", "2:4"],
                   help="targets also pruned with 4-bit kept weights")
    g.add_argument("--group-size", type=int, default=64, help="4-bit grid: inputs per scale")
    g.add_argument("--calib", default="../shared/corpus/train.txt")
    g.add_argument("--test", default="../shared/corpus/test.txt")
    g.add_argument("--calib-samples", type=int, default=32)
    g.add_argument("--calib-seq-len", type=int, default=256)
    g.add_argument("--ppl-max-tokens", type=int, default=16384, help="0: the whole test file")
    g.add_argument("--recover", type=_list,
                   default=["sparsegpt-s50", "sparsegpt-2of4"],
                   help="arms uptrained after pruning (distilled from the dense model)")
    g.add_argument("--recover-models", type=_list, default=["ref-mha"])
    g.add_argument("--recovery-tokens", type=int, default=500_000)
    g.add_argument("--work-dir", default="runs/prune-study")
    g.add_argument("--report", default="docs/pruning.md")
    g.add_argument("--report-only", action="store_true",
                   help="rewrite the report from results.json without running anything")
    g.add_argument("--threads", type=int)
    g.add_argument("--json", action="store_true", help="print the report's JSON")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=run_prune_experiment)


def run_prune_experiment(args) -> int:
    import torch

    from kvslim_lab.cli.report_command import write_study_report
    from kvslim_lab.experiments.prune.goals import goals
    from kvslim_lab.experiments.prune.report import report_data, write_report
    from kvslim_lab.experiments.prune.study import PruneExperiment, PruneExperimentConfig
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = PruneExperimentConfig(
        models=args.models, methods=args.methods, targets=args.targets,
        quantized_targets=args.quantized_targets, group_size=args.group_size,
        calib=args.calib, test=args.test, calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len, ppl_max_tokens=args.ppl_max_tokens or None,
        recover=args.recover, recover_models=args.recover_models,
        recovery_tokens=args.recovery_tokens, work_dir=args.work_dir, report=args.report,
        show_progress=not (args.quiet or args.json))
    exp = PruneExperiment(cfg)
    if not args.report_only:
        exp.run()
    return write_study_report(exp, args, write_report, report_data, goals)
