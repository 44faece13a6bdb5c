"""`kvslim import-gguf`, `kvslim export-gguf` and `kvslim info`."""
from __future__ import annotations

import json

from kvslim.cli.engine_args import add_engine_flags


def register(sub) -> None:
    from kvslim.dtypes import MODEL_DTYPES, QUANTIZED_KV_DTYPES
    from kvslim.formats.gguf.archs import SUPPORTED_GGUF_ARCHITECTURES
    from kvslim.formats.gguf.exporter import EXPORT_DTYPES
    p = sub.add_parser("import-gguf", help="convert a GGUF file to an HF model directory")
    p.add_argument("gguf", metavar="FILE",
                   help="GGUF file of one of the architectures "
                        f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (llama with experts: Mixtral)")
    p.add_argument("out", metavar="OUT_DIR", help="output model directory")
    add_engine_flags(p, "dtype", dtype=dict(
        default="auto", choices=("auto", "quantized", "float32"),
        help="auto (default): a file whose linear layers are all Q4_0, Q4_1, Q5_0, "
                        "Q8_0, Q4_K or Q6_K (any mix) keeps them quantized (the .gguf goes into "
                        "OUT_DIR), else float32 with a note; quantized: the same, but a linear "
                        "of another type is an error; float32: every tensor dequantized to "
                        "float32 safetensors"))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_import_gguf)

    p = sub.add_parser("export-gguf", help="write a model as a llama.cpp / Ollama GGUF file")
    p.add_argument("model", metavar="MODEL", help="model directory, .gguf file or 'default'")
    p.add_argument("out", metavar="FILE", help="output .gguf file")
    add_engine_flags(p, "dtype", dtype=dict(
        default="f16", aliases=("--outtype",),
        help=f"tensor type: {', '.join(EXPORT_DTYPES)} (default f16; norms stay f32; q4_0/q4_1 keep the token embeddings "
             "at q8_0)"))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_export_gguf)

    p = sub.add_parser("info", help="shape, attention layout and KV-cache cost of a model")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="model directory, .gguf file or 'default' (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    add_engine_flags(p, "dtype", dtype=dict(
        default=None, help="KV-cache dtype for the bytes per token: " + ", ".join(
            (*MODEL_DTYPES, *QUANTIZED_KV_DTYPES)) + " (a quantized one with its float16 "
        "scales, as the engine stores them; default: the weights' dtype)"))
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=run_info)


def run_import_gguf(args) -> int:
    from kvslim.formats.gguf.importer import import_gguf
    from kvslim.formats.info import model_info
    out = import_gguf(args.gguf, args.out, show_progress=not args.quiet,
                      keep_quantized=args.dtype == "auto",
                      require_quantized=args.dtype == "quantized")
    info = model_info(out)
    kind = "quantized linears read from the GGUF file" if _gguf_backed(out) else "float32"
    print(f"wrote {out} ({info.architecture}, {info.num_parameters:,} parameters, {kind})")
    return 0


def _gguf_backed(model_dir) -> bool:
    from pathlib import Path
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return (cfg.get("quantization_config") or {}).get("quant_method") == "gguf"


def run_export_gguf(args) -> int:
    import os
    from kvslim.formats.gguf.exporter import export_gguf
    from kvslim.formats.registry import resolve_model
    from kvslim.models.config import ModelConfig
    from kvslim.models.families import family_of
    model_dir = resolve_model(args.model)
    out = export_gguf(model_dir, args.out, args.dtype.lower(), show_progress=not args.quiet)
    arch = family_of(ModelConfig.from_dir(model_dir)).gguf.arch
    print(f"wrote {out} ({arch} GGUF, {args.dtype.lower()}, {os.path.getsize(out):,} bytes)")
    return 0


def run_info(args) -> int:
    from kvslim.formats.info import model_info
    from kvslim.formats.registry import resolve_model
    info = model_info(resolve_model(args.model), args.dtype)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
    else:
        print(format_info(info))
    return 0


def format_info(info) -> str:
    rope = f"theta {info.rope_theta:g}"
    if info.rope_scaling:
        rope += f", scaling {json.dumps(info.rope_scaling)}"
    rows = [
        ("model", info.model_dir),
        ("architecture", f"{info.architecture} ({info.model_type})"),
        ("parameters", f"{info.num_parameters / 1e6:.1f}M ({info.num_parameters:,}), "
                       f"stored as {info.weights_dtype}"),
        ("layers", str(info.num_hidden_layers)),
        ("hidden / FFN", f"{info.hidden_size} / {info.intermediate_size}"),
        ("attention", _attention_line(info)),
        ("head_dim", str(info.head_dim)),
        ("vocab", f"{info.vocab_size:,}"),
        ("max positions", f"{info.max_position_embeddings:,}"),
        ("rope", rope),
        ("tied embeddings", "yes" if info.tie_word_embeddings else "no"),
        ("KV cache / token", f"{info.kv_bytes_per_token:,} bytes "
                             f"({info.kv_bytes_per_token / 1024:.1f} KiB) in {info.kv_cache_dtype}"),
        ("quantization", info.quantization or "none (float weights)"),
    ]
    if info.kv_heads_per_layer:
        rows.insert(rows.index(("head_dim", str(info.head_dim))),
                    ("KV heads / layer", " ".join(map(str, info.kv_heads_per_layer))))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _attention_line(info) -> str:
    if info.kv_heads_per_layer:
        heads = info.kv_heads_per_layer
        return (f"{info.attention_kind}: {info.num_attention_heads} query heads, "
                f"{min(heads)} to {max(heads)} KV heads ({sum(heads)} over "
                f"{len(heads)} layers)")
    return (f"{info.attention_kind}: {info.num_attention_heads} query heads, "
            f"{info.num_key_value_heads} KV heads, group size {info.group_size}")
