"""`kvslim experiment gqa` (the GQA uptraining experiment) and `kvslim experiment quant` (every
quantization mode beside its peers), each writing its report; `speculative` and `prune` are
registered from their own files."""
from __future__ import annotations

import sys

from kvslim_lab.cli.report_command import report_args as _report_args


def register(sub) -> None:
    p = sub.add_parser("experiment", help="reproducible experiments")
    esub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    g = esub.add_parser("gqa", help="MHA -> GQA/MQA/MLA x methods x uptraining fraction, with the "
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
    g.add_argument("--methods", help="comma-separated arms (default: all; see --help of convert)")
    g.add_argument("--kv-heads", type=_ints, help="target KV heads (default: H/2, H/4, 1)")
    g.add_argument("--alphas", type=_floats, help="uptraining fractions of every arm "
                                                   "(default 0,0.05)")
    g.add_argument("--extra-alphas", type=_floats, help="fractions of mean/align arms only "
                                                         "(default 0.1)")
    g.add_argument("--mla-kv-heads", type=_ints,
                   help="MLA arms at these GQA counts' KV bytes (default: H/4, 1)")
    g.add_argument("--mla-rope-fraction", type=float, default=0.5,
                   help="share of an MLA arm's cached row that is the RoPE key")
    g.add_argument("--decode-batches", type=_ints,
                   help="batch sizes of the MLA vs GQA decode timing (default 1,32; '' none)")
    g.add_argument("--skip-smollm2", action="store_true")
    g.add_argument("--smollm2-steps", type=int, default=30)
    g.add_argument("--smollm2-ppl-max-tokens", type=int, default=12_000)
    g.add_argument("--smollm2-kd-steps", type=_ints, default=[30, 60],
                   help="uptraining steps of SmolLM2's distilled arms (default 30,60)")
    g.add_argument("--smollm2-mla-steps", type=int, default=30,
                   help="uptraining steps of SmolLM2's MLA arm (quarter of the KV bytes)")
    g.add_argument("--shard", default="0/1", metavar="I/N",
                   help="run jobs I, I+N, ... of the plan (N processes share --work-dir)")
    g.add_argument("--report-only", action="store_true",
                   help="rewrite the report from results.json without running anything")
    g.add_argument("--threads", type=int)
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=run_gqa)
    _register_quant(esub)
    from kvslim_lab.cli.experiment_spec_cmds import register_speculative
    register_speculative(esub)
    from kvslim_lab.cli.experiment_prune_cmds import register_prune
    register_prune(esub)


def _ints(text: str) -> list[int]:
    from kvslim.errors import KvslimError
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvslimError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    from kvslim.errors import KvslimError
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvslimError(f"expected comma-separated numbers, got {text!r}") from None


def _register_quant(esub) -> None:
    q = esub.add_parser("quant", help="every quantization mode (int8, RTN/GPTQ/AWQ 4-bit, W8A8, "
                                      "int8 KV, GGUF) beside llama.cpp and HF; writes "
                                      "docs/quantization.md")
    q.add_argument("--models", default="models/ref-mha,smollm2",
                   help="comma-separated: model directories, .gguf files, smollm2")
    q.add_argument("--arms", help="comma-separated subset of the arms (default: all)")
    q.add_argument("--calib", default="../shared/corpus/train.txt")
    q.add_argument("--test", default="../shared/corpus/test.txt")
    q.add_argument("--work-dir", default="runs/quant", help="built models and results.json")
    q.add_argument("--report", default="docs/quantization.md")
    q.add_argument("--group-sizes", type=_ints, default=[32, 128])
    q.add_argument("--no-sym", dest="sym", action="store_false", help="asymmetric 4-bit grids")
    q.add_argument("--calib-samples", type=int, default=32)
    q.add_argument("--calib-seq-len", type=int, default=256)
    q.add_argument("--ppl-context", type=int, default=256)
    q.add_argument("--ppl-stride", type=int, default=256)
    q.add_argument("--ppl-max-tokens", type=int, default=8192, help="0: the whole test file")
    q.add_argument("--num-prompts", type=int, default=64, help="offline throughput workload")
    q.add_argument("--input-len", type=int, default=128)
    q.add_argument("--output-len", type=int, default=128)
    q.add_argument("--decode-input-len", type=int, default=128, help="batch-1 decode prompt")
    q.add_argument("--decode-output-len", type=int, default=64)
    q.add_argument("--decode-repeats", type=int, default=3)
    q.add_argument("--hf-batch-sizes", type=_ints, default=[8, 32])
    q.add_argument("--llamacpp-bin", default=".cache/llamacpp/build/bin",
                   help="llama.cpp tools (benchmarks/build_llamacpp.sh); '' skips them")
    q.add_argument("--llamacpp-parallel", type=_ints, default=[4, 16, 64],
                   help="llama-batched-bench -npl values; the best counts")
    q.add_argument("--capacity-kv-memory", default="64MiB")
    q.add_argument("--capacity-context", type=int, default=256)
    q.add_argument("--report-only", action="store_true",
                   help="rewrite the report from results.json without running anything")
    q.add_argument("--threads", type=int)
    q.add_argument("--json", action="store_true", help="print the report's JSON")
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(func=run_quant)


def run_quant(args) -> int:
    import torch

    from kvslim_lab.cli.report_command import write_study_report
    from kvslim_lab.experiments.quant.report import goals, report_data, write_report
    from kvslim_lab.experiments.quant.study import QuantExperiment, QuantExperimentConfig
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = QuantExperimentConfig(
        models=[m.strip() for m in args.models.split(",") if m.strip()],
        arms=[a.strip() for a in args.arms.split(",")] if args.arms else None,
        calib=args.calib, test=args.test, work_dir=args.work_dir, report=args.report,
        group_sizes=args.group_sizes, sym=args.sym, calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len, ppl_context=args.ppl_context,
        ppl_stride=args.ppl_stride, ppl_max_tokens=args.ppl_max_tokens or None,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        decode_input_len=args.decode_input_len, decode_output_len=args.decode_output_len,
        decode_repeats=args.decode_repeats, hf_batch_sizes=args.hf_batch_sizes,
        llamacpp_bin=args.llamacpp_bin or None, llamacpp_parallel=args.llamacpp_parallel,
        capacity_kv_memory=args.capacity_kv_memory, capacity_context=args.capacity_context,
        show_progress=not (args.quiet or args.json))
    exp = QuantExperiment(cfg)
    if not args.report_only:
        exp.run()
    return write_study_report(exp, args, write_report, report_data, goals)


def run_gqa(args) -> int:
    import torch

    from kvslim_lab.experiments.gqa.report import goal_checks, write_report
    from kvslim_lab.experiments.gqa.study import Experiment, ExperimentConfig
    if args.threads:
        torch.set_num_threads(args.threads)
    shard = _parse_shard(args.shard)
    cfg = ExperimentConfig(model=args.model, train=args.train, valid=args.valid, test=args.test,
                           work_dir=args.work_dir, report=args.report,
                           original_steps=args.original_steps, uptrain_lr=args.uptrain_lr,
                           ppl_max_tokens=args.ppl_max_tokens or None,
                           smollm2=not args.skip_smollm2,
                           smollm2_steps=args.smollm2_steps,
                           smollm2_ppl_max_tokens=args.smollm2_ppl_max_tokens, shard=shard,
                           smollm2_kd_steps=args.smollm2_kd_steps,
                           smollm2_mla_steps=args.smollm2_mla_steps,
                           mla_rope_fraction=args.mla_rope_fraction,
                           **_plan_overrides(args))
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


def _plan_overrides(args) -> dict:
    from kvslim.errors import KvslimError
    from kvslim_lab.experiments.gqa.study import METHODS
    out = {}
    if args.methods:
        out["methods"] = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in out["methods"] if m not in METHODS]
        if unknown:
            raise KvslimError(f"unknown --methods {', '.join(unknown)}; choose from "
                              f"{', '.join(METHODS)}")
    for name in ("kv_heads", "alphas", "extra_alphas", "mla_kv_heads", "decode_batches"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


def _parse_shard(text: str) -> tuple[int, int]:
    from kvslim.errors import KvslimError
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise KvslimError(f"--shard must look like I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise KvslimError(f"--shard {text}: need 0 <= I < N")
    return i, n
