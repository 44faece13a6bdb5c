"""`kvslim memory`: will it fit? Weight and KV-cache bytes for a model directory, a config.json
or a built-in published config, at a context, batch, dtype and device budget."""
from __future__ import annotations

import json
from pathlib import Path

from kvslim.cli.engine_args import add_engine_flags
from kvslim.dtypes import DTYPES


def register(sub) -> None:
    p = sub.add_parser("memory", help="weight and KV-cache bytes of a model; what fits in memory")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="model directory, config.json, .gguf file or built-in name (see --list; "
                        "default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--list", action="store_true", help="list the built-in published configs")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences (default 1)")
    add_engine_flags(p, "dtype", dtype=dict(
        default=None, help=f"weight dtype: {', '.join(d.short for d in DTYPES)} (default: the dtype in "
                           "config.json)"))
    p.add_argument("--kv-dtype", help="KV-cache dtype, same choices (default: --dtype, or fp16 "
                                      "when the weights are 8 or 4 bits)")
    p.add_argument("--memory", help="device budget, e.g. 24GiB or 80GB (GB = 10^9, GiB = 2^30)")
    add_engine_flags(
        p, "block_size", "tensor_parallel_size",
        block_size=dict(help="KV block size in tokens, as the engine allocates (default: the "
                             "engine's for --kv-dtype)"),
        tensor_parallel_size=dict(help="also show one rank's share at N tensor-parallel ranks: "
                                       "its weights, its KV heads (replicated when N exceeds "
                                       "them) and what fits in --memory per device"))
    p.add_argument("--json", action="store_true", help="print the plan as JSON (exact bytes)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of KV bytes vs context")
    p.set_defaults(func=run_memory)


def run_memory(args) -> int:
    from kvslim.plan.memory import markdown_table, plan_memory, plot_kv
    from kvslim.engine.config import parse_bytes
    if args.list:
        print(format_builtin_list())
        return 0
    memory = None if args.memory is None else parse_bytes(args.memory)
    config = resolve_model_config(args.model)
    plan = plan_memory(config, args.context, args.batch, args.dtype, args.kv_dtype, memory,
                       args.block_size)
    if args.plot:
        plot_kv(plan, args.plot)
    ranks = rank_plans(config, args, memory)
    if args.json:
        data = plan.to_dict()
        if ranks is not None:
            data["tensor_parallel"] = ranks
        print(json.dumps(data, indent=2))
        return 0
    print(format_plan(plan))
    print()
    print(f"KV cache vs context, batch {plan.batch}, {plan.kv_dtype} (GB = 10^9 bytes):")
    print(markdown_table(plan))
    if ranks is not None:
        print()
        print(format_ranks(ranks))
    if args.plot:
        print(f"\nwrote {args.plot}")
    return 0


def rank_plans(config, args, memory: int | None) -> dict | None:
    """One rank's share at --tensor-parallel-size (every rank holds the same), or None at 1:
    `parallel.memory`'s per-rank bytes and the planner run on one rank's shapes."""
    from dataclasses import asdict

    from kvslim.parallel.memory import rank_config, tensor_parallel_memory
    from kvslim.plan.memory import plan_memory
    n = args.tensor_parallel_size
    if n == 1:
        return None
    rank = tensor_parallel_memory(config, n, args.dtype, args.kv_dtype)
    shard = plan_memory(rank_config(config, n), args.context, args.batch, args.dtype,
                        args.kv_dtype, memory, args.block_size)
    own = next(lp for lp in shard.layouts if lp.is_model)
    return {**asdict(rank), "kv_bytes": own.kv_bytes, "replicated": rank.replicated,
            "capacity": None if own.capacity is None else asdict(own.capacity)}


def format_ranks(r: dict) -> str:
    from kvslim.plan.memory import both_units
    heads = sorted(set(r["kv_heads_per_layer"]))
    replicas = max(r["kv_replicas_per_layer"])
    lines = [f"Per rank at --tensor-parallel-size {r['world_size']} (every rank the same):",
             f"{'weights (' + r['weights_dtype'] + ')':<32} {r['weight_bytes']:>20,} B   "
             f"{both_units(r['weight_bytes'])}",
             f"{'KV per token (' + r['kv_dtype'] + ')':<32} {r['kv_bytes_per_token']:>20,} B   "
             f"{both_units(r['kv_bytes_per_token'])}",
             f"{'KV for the context x batch':<32} {r['kv_bytes']:>20,} B   "
             f"{both_units(r['kv_bytes'])}",
             f"KV heads per layer on a rank: {' '.join(map(str, heads))}"
             + (f" (each replicated on {replicas} ranks: beyond the model's KV heads, more "
                "ranks no longer shrink a rank's cache)" if r["replicated"] else "")]
    cap = r["capacity"]
    if cap is not None:
        lines.append(f"fits per device: {cap['max_tokens']:,} tokens, "
                     f"{cap['max_sequences']:,} sequences of the context")
    return "\n".join(lines)


def resolve_model_config(model: str | None):
    """A model directory, a config.json, a .gguf file, a built-in name, or None (the embedded
    default model). An existing path wins over a built-in name it happens to match. Configs are
    read for their shapes only: the planner also sizes architectures the engine does not run."""
    from kvslim.errors import KvslimError
    from kvslim.formats.registry import EMBEDDED_NAMES, resolve_model
    from kvslim.models.config import ModelConfig
    from kvslim.plan.published import builtin_config, builtin_names
    if model is None or model in EMBEDDED_NAMES:
        return ModelConfig.from_dir(resolve_model(model), runnable=False)
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelConfig.from_dir(path, runnable=False)
    if path.is_file() and path.suffix.lower() == ".json":
        return ModelConfig.from_file(path, runnable=False)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelConfig.from_dir(resolve_model(path), runnable=False)
    config = builtin_config(model)
    if config is None:
        raise KvslimError(f"unknown model {model!r}: not a model directory, config.json, .gguf "
                          f"file or built-in name ({', '.join(builtin_names())})")
    return config


def format_builtin_list() -> str:
    from kvslim.plan.parameters import parameter_counts
    from kvslim.plan.published import builtin_config, builtin_names
    rows = [("name", "source config.json", "layers", "heads/KV", "attention", "parameters")]
    for name in builtin_names():
        s = builtin_config(name)
        total, active = parameter_counts(s)
        params = f"{total / 1e9:.2f}B" + (f" ({active / 1e9:.1f}B active)" if active != total
                                          else "")
        rows.append((name, s.source, str(s.num_hidden_layers),
                     f"{s.num_attention_heads}/{s.num_key_value_heads}", s.attention_kind, params))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def format_plan(plan) -> str:
    from kvslim.plan.memory import both_units
    s = plan.model
    heads = f"{s.num_attention_heads} query heads"
    if s.mla:
        attention = (f"MLA, {heads}, cached latent {s.mla.kv_lora_rank} + RoPE key "
                     f"{s.mla.qk_rope_head_dim} per layer, head_dim {s.head_dim} (K) / "
                     f"{s.v_head_dim} (V)")
    elif s.layer_kv_heads:
        attention = (f"{s.attention_kind}, {heads}, KV heads per layer "
                     f"{' '.join(map(str, s.layer_kv_heads))}, head_dim {s.head_dim}")
    else:
        attention = (f"{s.attention_kind}, {heads}, {s.num_key_value_heads} KV heads "
                     f"(group {s.num_attention_heads // s.num_key_value_heads}), "
                     f"head_dim {s.head_dim}")
    params = f"{plan.num_parameters:,}"
    if plan.num_active_parameters != plan.num_parameters:
        params += f" ({plan.num_active_parameters:,} active per token)"
    lines = [
        f"{s.name}  ({s.source})",
        f"  {s.architecture}: {s.num_hidden_layers} layers, hidden {s.hidden_size}, "
        f"FFN {s.intermediate_size}, vocab {s.vocab_size:,}, "
        f"{'tied' if s.tie_word_embeddings else 'untied'} embeddings, "
        f"{s.max_position_embeddings:,} positions",
        f"  attention: {attention}",
        f"  parameters: {params}",
        "Units: GB = 10^9 bytes, GiB = 2^30 bytes (in brackets); --json gives exact bytes.",
        "",
    ]
    rows = [(f"weights ({plan.weights_dtype})", plan.weight_bytes),
            (f"KV per token ({plan.kv_dtype})", plan.kv_bytes_per_token),
            (f"KV for {plan.context:,} tokens x {plan.batch}", plan.kv_bytes)]
    if plan.memory_bytes is not None:
        rows += [("memory budget", plan.memory_bytes), ("left for KV after weights",
                                                        max(0, plan.free_bytes))]
    for label, n in rows:
        lines.append(f"{label:<32} {n:>20,} B   {both_units(n)}")
    own = next(lp for lp in plan.layouts if lp.is_model)
    lines[-len(rows) + 1] += f"   = {own.kv_elements_per_token:,} elements"
    lines += [f"note: {note}" for note in plan.notes]
    lines += ["", layouts_table(plan)]
    if any(g.window is not None for g in plan.kv_groups):
        lines += ["", groups_table(plan)]
    return "\n".join(lines)


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> '0-2 4 6-7'."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return " ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def groups_table(plan) -> str:
    """Per KV-cache group (layers sharing block tables), what a sequence holds at --context:
    the blocks the engine keeps for it, and their bytes."""
    from kvslim.plan.memory import both_units
    lines = [f"KV-cache groups at {plan.context:,} tokens x {plan.batch} "
             f"(blocks of {plan.block_size} tokens):",
             "| layers | window | bytes/token | blocks per sequence | bytes |",
             "|---|---:|---:|---:|---:|"]
    for g in plan.kv_groups:
        window = "full" if g.window is None else f"{g.window:,}"
        lines.append(f"| {layer_ranges(g.layers)} | {window} | {g.bytes_per_token:,} | "
                     f"{g.blocks_per_sequence:,} | {both_units(g.bytes)} |")
    return "\n".join(lines)


def layouts_table(plan) -> str:
    """The model's KV layout beside its MHA and MQA equivalents, as a markdown table."""
    from kvslim.plan.memory import both_units
    head = ["KV layout", "bytes/token", f"{plan.context:,} tokens x {plan.batch}"]
    if plan.memory_bytes is not None:
        windowed = any(g.window is not None for g in plan.kv_groups)
        head += ["token slots per KV-cache group" if windowed else "tokens that fit",
                 f"sequences of {plan.context:,} that fit"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for lp in plan.layouts:
        cells = [lp.label, f"{lp.kv_bytes_per_token:,}", both_units(lp.kv_bytes)]
        if lp.capacity is not None:
            cells += [f"{lp.capacity.max_tokens:,}", f"{lp.capacity.max_sequences:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
