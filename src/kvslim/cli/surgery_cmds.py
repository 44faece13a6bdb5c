"""`kvslim convert`, `kvslim uptrain` and `kvslim ppl`."""
from __future__ import annotations

import json

from kvslim.cli.engine_args import add_engine_flags
from kvslim.cli.train_cmds import add_loop_args, loop_kwargs, record_command
from kvslim.dtypes import MODEL_DTYPES
from kvslim.errors import KvslimError


def register(sub) -> None:
    p = sub.add_parser("convert", help="MHA -> GQA/MQA: pool KV heads into --kv-heads groups; "
                                       "or --to-mla: DeepSeek-V2 latent attention")
    p.add_argument("src", metavar="SRC", help="source model directory")
    p.add_argument("dst", metavar="DST", help="output model directory")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--kv-heads", type=int, help="target number of KV heads, every layer")
    target.add_argument("--kv-budget", type=float, metavar="FRACTION",
                        help="per-layer KV heads within this fraction of the source's KV bytes")
    target.add_argument("--kv-bytes-per-token", type=int, metavar="N",
                        help="per-layer KV heads within N bytes per token (stored dtype)")
    _add_mla_args(p, target)
    p.add_argument("--allocate", default="sensitivity", choices=("sensitivity", "uniform"),
                   help="with a budget: spend it where merging costs most (measured on --calib),"
                        " or the same count in every layer")
    p.add_argument("--sensitivity-samples", type=int, default=8,
                   help="calibration windows the per-layer loss is measured on")
    p.add_argument("--method", help="mean, first, random or align (default: mean; align "
                                    "with a budget); with --to-mla mha2mla (default) or transmla")
    p.add_argument("--calib", help="calibration text file (needed by --method align)")
    p.add_argument("--calib-samples", type=int, default=32, help="calibration windows")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="warn when the KV heads chosen would have to be replicated (or cannot "
                        "be split) across N tensor-parallel ranks")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true",
                   help="print the result (per-layer KV heads, measured losses) as JSON")
    p.set_defaults(func=run_convert)

    p = sub.add_parser("uptrain", help="continue training a converted or pruned model (a "
                                       "pruned model's zeros stay zero)")
    p.add_argument("model", metavar="MODEL", help="model directory to start from")
    p.add_argument("--data", required=True)
    p.add_argument("--valid")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--fraction", type=float, help="uptrain for this fraction of --of-steps")
    p.add_argument("--of-steps", type=int, help="the original training's step count")
    p.add_argument("--teacher", metavar="SRC",
                   help="distil from this model (the unconverted one; same tokenizer)")
    p.add_argument("--distill-temperature", type=float, default=2.0, metavar="T",
                   help="softmax temperature of the distillation KL (default 2)")
    p.add_argument("--distill-weight", type=float, default=0.5, metavar="W",
                   help="loss = (1-W) * cross-entropy + W * T^2 * KL (default 0.5)")
    p.add_argument("--match-attention", action="store_true",
                   help="also match each layer's attention output to the teacher's (MSE)")
    p.add_argument("--attention-weight", type=float, default=1.0, metavar="A",
                   help="weight of the attention-matching term (default 1)")
    add_loop_args(p, steps=100, lr=2e-4, warmup=-1)
    p.set_defaults(func=run_uptrain)

    _register_ppl(sub)


def _add_mla_args(p, target) -> None:
    target.add_argument("--to-mla", action="store_true",
                        help="DeepSeek-V2 latent attention (docs/mla-conversion.md)")
    p.add_argument("--kv-lora-rank", type=int, metavar="R", help="--to-mla: the latent's width")
    p.add_argument("--rope-dim", type=int, metavar="D",
                   help="--to-mla: RoPE dims each query head keeps (default: head_dim for "
                        "transmla, head_dim / 4 for mha2mla)")
    p.add_argument("--latent-norm", default="calibrated", choices=("calibrated", "exact"),
                   help="--to-mla: kv_a_layernorm's weight the latent's RMS (trainable), or the "
                        "latent scaled below its epsilon (exact, not for uptraining)")


def _register_ppl(sub) -> None:
    p = sub.add_parser("ppl", help="sliding-window perplexity of a model on a text file")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="model directory (default: the embedded model)")
    p.add_argument("--data", required=True)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--max-tokens", type=int, help="score only the first N tokens")
    add_engine_flags(p, "dtype", dtype=dict(default="float32", choices=None,
                                            help=f"{', '.join(MODEL_DTYPES)} (default float32)"))
    p.add_argument("--device", default="cpu")
    add_engine_flags(p, "linear_activations", linear_activations=dict(
        default=None, help="score the engine's kernels with float32 or int8 activations "
                           "(default: the weights dequantized, in float32)"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_ppl)


def run_convert(args) -> int:
    from kvslim.models.config import ModelConfig
    from kvslim.surgery.convert import convert_to_budget, convert_to_gqa
    show = not (args.quiet or args.json)
    if args.to_mla:
        return run_convert_mla(args, show)
    if args.kv_heads is not None:
        _warn_tensor_parallel(args, ModelConfig.from_dir(args.src).num_attention_heads,
                              [args.kv_heads])
        method = args.method or "mean"
        out = convert_to_gqa(args.src, args.dst, args.kv_heads, method, args.calib,
                             args.calib_samples, args.calib_seq_len, args.seed, show)
        record = {"allocation": None, "method": method}
    else:
        method = args.method or "align"
        out = convert_to_budget(args.src, args.dst, args.allocate, args.kv_budget,
                                args.kv_bytes_per_token, method, args.calib, args.calib_samples,
                                args.calib_seq_len, args.sensitivity_samples, args.seed, show)
        record = json.loads((out / "kv_allocation.json").read_text())
    config = ModelConfig.from_dir(out)
    heads = config.kv_heads_per_layer
    warning = (_warn_tensor_parallel(args, config.num_attention_heads, heads)
               if args.kv_heads is None else _tensor_parallel_note(args, config, heads))
    if args.json:
        print(json.dumps({**record, "model": str(out), "kv_heads": list(heads),
                          "kv_bytes_per_token": config.kv_bytes_per_token(config.torch_dtype),
                          "tensor_parallel_warning": warning}))
    elif args.kv_heads is not None:
        print(f"wrote {out} ({args.kv_heads} KV heads, method {method})")
    else:
        print(f"wrote {out} (KV heads per layer {' '.join(map(str, heads))}: {sum(heads)} in "
              f"all, allocation {args.allocate}, method {method})")
    return 0


def run_convert_mla(args, show: bool) -> int:
    from kvslim.surgery.mla.convert import RECORD, convert_to_mla
    from kvslim.surgery.mla.options import MLAOptions
    if args.kv_lora_rank is None:
        raise KvslimError("--to-mla needs --kv-lora-rank R")
    options = MLAOptions(method=args.method or "mha2mla", kv_lora_rank=args.kv_lora_rank,
                         rope_dim=args.rope_dim, latent_norm=args.latent_norm, calib=args.calib,
                         calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len)
    out = convert_to_mla(args.src, args.dst, options, show)
    record = json.loads((out / RECORD).read_text())
    if args.json:
        print(json.dumps({**record, "model": str(out)}))
    else:
        print(f"wrote {out} (DeepSeek-V2 latent attention, method {record['method']}: "
              f"kv_lora_rank {record['kv_lora_rank']}, qk_rope_head_dim "
              f"{record['qk_rope_head_dim']}; KV bytes per token "
              f"{record['source_kv_bytes_per_token']} -> {record['kv_bytes_per_token']})")
    return 0


def _tensor_parallel_note(args, config, heads) -> str | None:
    from kvslim.parallel.sharding import replication_warning
    if args.tensor_parallel_size is None:
        return None
    return replication_warning(config.num_attention_heads, heads, args.tensor_parallel_size)


def _warn_tensor_parallel(args, num_heads: int, heads) -> str | None:
    """Print (stderr) and return the replication warning for --tensor-parallel-size."""
    import sys

    from kvslim.parallel.sharding import replication_warning
    if args.tensor_parallel_size is None:
        return None
    warning = replication_warning(num_heads, heads, args.tensor_parallel_size)
    if warning:
        print(f"kvslim convert: warning: {warning}", file=sys.stderr)
    return warning


def uptrain_steps(args) -> int:
    if args.fraction is None:
        return args.steps
    if args.of_steps is None or args.of_steps <= 0 or not 0 < args.fraction <= 1:
        raise KvslimError("--fraction needs a value in (0, 1] and a positive --of-steps")
    return max(1, round(args.fraction * args.of_steps))


def run_uptrain(args) -> int:
    from kvslim.train.train_config import TrainConfig
    from kvslim.train.trainer import train
    steps = uptrain_steps(args)
    kwargs = loop_kwargs(args)
    kwargs.update(steps=steps,
                  warmup_steps=args.warmup_steps if args.warmup_steps >= 0 else max(1, steps // 10),
                  eval_every=min(args.eval_every, steps), save_every=min(args.save_every, steps))
    cfg = TrainConfig(data=args.data, valid=args.valid, out=args.out, init_from=args.model,
                      seq_len=args.seq_len or 256, teacher=args.teacher,
                      distill_temperature=args.distill_temperature,
                      distill_weight=args.distill_weight, match_attention=args.match_attention,
                      attention_weight=args.attention_weight, **kwargs)
    record_command(args.out)
    metrics = train(cfg, show_progress=not args.quiet)
    print(json.dumps(metrics) if args.json else f"done: {metrics}")
    return 0


def run_ppl(args) -> int:
    from kvslim.formats.registry import resolve_model
    from kvslim.eval.perplexity import file_perplexity
    result = file_perplexity(resolve_model(args.model), args.data, args.context, args.stride,
                             args.max_tokens, args.dtype, args.device, show_progress=not args.json,
                             linear_activations=args.linear_activations)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"perplexity {result.perplexity:.4f} (nll {result.nll:.4f} over "
              f"{result.num_tokens} tokens, context {result.context}, stride {result.stride})")
    return 0
