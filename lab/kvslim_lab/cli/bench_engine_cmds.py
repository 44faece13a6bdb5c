"""`kvslim bench throughput | latency | profile | capacity | kernels | structured | lora |
kv-tier`."""
from __future__ import annotations

import json

import torch

from kvslim.cli.engine_args import (PARALLEL_OPTIONS, add_engine_flags, add_threads_arg,
                                   engine_options_from_args, parallel_from_args)
from kvslim.errors import KvslimError

# --dtype here chooses which import of the default model and .gguf files runs.
IMPORT_DTYPE = dict(choices=("auto", "float32"),
                    help="auto: the default model and .gguf files run their quantized import; "
                         "float32: their float32 import")
# The peers (HF, llama.cpp) run without these.
KVSLIM_ONLY = dict(kv_cache_dtype=dict(help="kvslim's KV-cache storage (default auto: the model's "
                                            "dtype)"),
                   speculative=dict(help="kvslim's speculative decoding, as for generate and "
                                         "serve"),
                   linear_activations=dict(help="kvslim's group-quantized layers: int8 (default) "
                                                "or float32 activations"))


def _common(p) -> None:
    add_threads_arg(p, help="torch (and llama.cpp) threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def register_engine_benchmarks(kinds) -> None:
    p = kinds.add_parser("throughput", help="offline throughput vs HF transformers and llama.cpp")
    p.add_argument("--model", default=None, help="model directory (default: embedded model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare", default="hf,llamacpp", help="peers: hf, llamacpp, or ''")
    p.add_argument("--hf-batch-size", type=int, default=8)
    add_engine_flags(p, "kv_cache_memory", "kv_cache_dtype", "speculative", "dtype",
                     "linear_activations", kv_cache_memory=dict(default="2GiB"),
                     dtype=IMPORT_DTYPE, **KVSLIM_ONLY)
    _common(p)
    add_engine_flags(p, *PARALLEL_OPTIONS)
    p.set_defaults(func=run_throughput_cmd)

    p = kinds.add_parser("latency", help="batch-1/8 decode speed and roofline vs peers")
    p.add_argument("--model", default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--compare", default="hf,llamacpp")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds, engines taking turns in each; tables show medians")
    add_engine_flags(p, "kv_cache_dtype", "speculative", "dtype", "linear_activations",
                     dtype=IMPORT_DTYPE, **KVSLIM_ONLY)
    _common(p)
    add_engine_flags(p, *PARALLEL_OPTIONS)
    p.set_defaults(func=run_latency_cmd)

    p = kinds.add_parser("profile", help="where a decode step's time goes: GEMM, attention, "
                                         "other ops, outside ops")
    p.add_argument("--model", default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=16, help="decode steps profiled per batch")
    add_engine_flags(p, "dtype", "compile_decode", dtype=IMPORT_DTYPE)
    _common(p)
    p.set_defaults(func=run_profile_cmd)

    p = kinds.add_parser("capacity", help="an MHA model vs its GQA/MQA conversions, one budget")
    p.add_argument("--model", default="models/ref-mha", help="the MHA model")
    p.add_argument("--kv-heads", default=None, help="conversions to compare (default H/4,1)")
    p.add_argument("--mla", action="store_true",
                   help="also each conversion's latent-attention (MLA) twin at its KV bytes")
    add_engine_flags(p, "kv_cache_memory", kv_cache_memory=dict(default="64MiB"))
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--work-dir", default="runs/capacity")
    _common(p)
    p.set_defaults(func=run_capacity_cmd)

    _register_kernels(kinds)
    _register_structured(kinds)
    _register_lora(kinds)
    _register_kv_tier(kinds)


def _register_kernels(kinds) -> None:
    p = kinds.add_parser("kernels", help="linear kernels (float32, int8, int4, W8A8) on "
                                         "SmolLM2-135M's shapes: µs, GB/s, GOP/s per batch")
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="row counts M")
    p.add_argument("--shapes", default=None,
                   help="comma list of qkv,o,gate_up,down,lm_head or NAME=IN:OUT (default all)")
    p.add_argument("--groups", default="32,64,128", help="4-bit group sizes")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; cells are medians")
    p.add_argument("--target-ms", type=float, default=20.0, help="time per measurement")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile candidates")
    p.add_argument("--no-torchao", action="store_true", help="leave out torchao candidates")
    _common(p)
    p.set_defaults(func=run_kernels_cmd)


def _register_structured(kinds) -> None:
    p = kinds.add_parser("structured", help="what JSON-schema constrained decoding costs a "
                                            "decode step (plain vs constrained, same batch)")
    p.add_argument("--model", default=None, help="model (default: the embedded model)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the two runs alternating")
    _common(p)
    p.set_defaults(func=run_structured_cmd)


def run_structured_cmd(args) -> int:
    from kvslim_lab.bench.structured import format_structured, run_structured_bench
    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.batch, args.tokens, args.rounds) < 1:
        raise KvslimError("--batch, --tokens and --rounds must be at least 1")
    result = run_structured_bench(args.model, args.batch, args.tokens, args.rounds,
                                  show_progress=not args.json)
    return _emit(args, result, format_structured)


def _register_lora(kinds) -> None:
    p = kinds.add_parser("lora", help="what serving LoRA adapters costs a decode step: 0, 1, 4 "
                                      "and 8 distinct adapters in one batch vs the base alone")
    p.add_argument("--model", default=None, help="model (default: the embedded model)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--counts", default="0,1,4,8", help="distinct adapters per run")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the runs alternating")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw tokens/s per run (bars) into this file")
    add_engine_flags(p, "dtype", dtype=IMPORT_DTYPE)
    _common(p)
    p.set_defaults(func=run_lora_cmd)


def run_lora_cmd(args) -> int:
    from kvslim_lab.bench.lora import format_lora, run_lora_bench
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = tuple(int(c) for c in args.counts.split(","))
    if min(args.batch, args.tokens, args.rounds, args.rank) < 1 or min(counts) < 0 \
            or max(counts) < 1:
        raise KvslimError("--batch, --tokens, --rounds and --rank must be at least 1, --counts "
                          "at least 0 (and one of them at least 1)")
    result = run_lora_bench(args.model, args.batch, args.tokens, args.rank, args.rounds,
                            counts, args.dtype, show_progress=not args.json)
    if args.plot:
        from pathlib import Path

        from kvslim_lab.bench.lora import plot_lora
        plot_lora({f"dtype {args.dtype}": result}, Path(args.plot))
    return _emit(args, result, format_lora)


def _register_kv_tier(kinds) -> None:
    p = kinds.add_parser("kv-tier", help="time to the first token of long prompts: cold, from "
                                         "the pool, from host memory and from disk")
    p.add_argument("--model", default=None, help="model (default: the embedded model)")
    p.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    p.add_argument("--rounds", type=int, default=3, help="measurements of each; medians")
    p.add_argument("--plot", default=None, metavar="PNG", help="also draw the TTFTs (bars)")
    add_engine_flags(p, "dtype", dtype=IMPORT_DTYPE)
    _common(p)
    p.set_defaults(func=run_kv_tier_cmd)


def run_kv_tier_cmd(args) -> int:
    from kvslim_lab.bench.kv_tier import format_kv_tier, plot_kv_tier, run_kv_tier_bench
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = tuple(int(n) for n in args.lengths.split(","))
    if min(lengths) < 2 or args.rounds < 1:
        raise KvslimError("--lengths must be at least 2 tokens, --rounds at least 1")
    result = run_kv_tier_bench(args.model, lengths, args.rounds, args.dtype,
                               show_progress=not args.json)
    if args.plot:
        plot_kv_tier(result, args.plot)
    return _emit(args, result, format_kv_tier)


def _setup(args):
    from kvslim.formats.registry import engine_model_dir
    if args.threads:
        torch.set_num_threads(args.threads)
    return engine_model_dir(getattr(args, "model", None), getattr(args, "dtype", "float32"))


def _emit(args, result, fmt) -> int:
    print(json.dumps(result.to_dict(), indent=2) if args.json else fmt(result))
    return 0


def run_throughput_cmd(args) -> int:
    from kvslim_lab.bench.runners import parse_compare
    from kvslim_lab.bench.throughput import format_throughput, run_throughput
    from kvslim_lab.bench.workload import Workload
    model = _setup(args)
    w = Workload(args.num_prompts, args.input_len, args.output_len)
    result = run_throughput(model, w, parse_compare(args.compare), args.hf_batch_size,
                            args.kv_cache_memory, show_progress=not args.json,
                            kv_cache_dtype=args.kv_cache_dtype,
                            speculative=_speculative_config(args),
                            parallel=parallel_from_args(args),
                            linear_activations=args.linear_activations)
    return _emit(args, result, format_throughput)


def run_latency_cmd(args) -> int:
    from kvslim_lab.bench.latency import format_latency, run_latency
    from kvslim_lab.bench.runners import parse_compare
    model = _setup(args)
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.repeats < 1:
        raise KvslimError(f"--repeats must be at least 1, got {args.repeats}")
    result = run_latency(model, args.input_len, args.output_len, batches,
                         parse_compare(args.compare), show_progress=not args.json,
                         repeats=args.repeats, kv_cache_dtype=args.kv_cache_dtype,
                         speculative=_speculative_config(args),
                         parallel=parallel_from_args(args),
                         linear_activations=args.linear_activations)
    return _emit(args, result, format_latency)


def _speculative_config(args) -> dict | None:
    """Parsed and checked before any model loads."""
    from kvslim.engine.speculative.config import SpeculativeConfig
    value = engine_options_from_args(args)["speculative"]
    SpeculativeConfig.from_value(value)
    return value


def run_profile_cmd(args) -> int:
    from kvslim_lab.bench.profile import format_profile, profile_decode
    model = _setup(args)
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.steps < 1 or min(batches) < 1:
        raise KvslimError("--steps and every --batches entry must be at least 1")
    return _emit(args, profile_decode(model, batches, args.input_len, args.steps,
                                      compile_decode=engine_options_from_args(args)[
                                          "compile_decode"]), format_profile)


def run_capacity_cmd(args) -> int:
    from pathlib import Path

    from kvslim_lab.bench.capacity import conversions, format_capacity, run_capacity
    from kvslim.models.config import ModelConfig
    model = _setup(args)
    h = ModelConfig.from_dir(model).num_key_value_heads
    ks = [int(k) for k in args.kv_heads.split(",")] if args.kv_heads else sorted({h // 4, 1},
                                                                                 reverse=True)
    dirs = conversions(model, ks, Path(args.work_dir), show_progress=not args.json,
                       mla=args.mla)
    result = run_capacity(dirs, args.kv_cache_memory, args.context, args.num_requests,
                          show_progress=not args.json)
    return _emit(args, result, format_capacity)


def run_kernels_cmd(args) -> int:
    from kvslim_lab.bench.kernels import format_kernels, parse_shapes, run_kernels
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.rounds < 1 or min(batches) < 1:
        raise KvslimError("--rounds and every --batches entry must be at least 1")
    result = run_kernels(parse_shapes(args.shapes), batches,
                         tuple(int(g) for g in args.groups.split(",")), args.rounds,
                         args.target_ms, not args.no_compile, not args.no_torchao)
    return _emit(args, result, format_kernels)
