"""The memory planner: weight bytes, KV-cache bytes per token and for a context x batch, the same
model's MHA- and MQA-equivalent cache, and what fits in a device budget.

Every figure is an exact integer count of bytes computed from the model's shapes; rounding happens
only when a number is shown. Capacity is counted the way the engine allocates it (whole blocks of
`block_size` tokens from the bytes left after the weights), so for a model the engine loads the
planner's bytes per token and blocks are exactly the engine's (tests/bench/test_memory.py).

An int8 or fp8 KV cache is counted as the engine stores it: the elements plus one float16 scale
per token and KV head (`ModelConfig.kv_scale_bytes_per_token`). Not counted: activations, the
framework's workspace and allocator slack, and the scales of int4 (KV or weights) and of
quantized weights."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig
from kvslim.kv_cache.groups import KVCacheGroups, blocks_held, kv_cache_groups
from kvslim.dtypes import DTYPES, lookup, packed_kv_bits
from kvslim.kv_cache.plan import (DEFAULT_BLOCK_SIZE, ENGINE_KV_DTYPES, PACKED_BLOCK_SIZE,
                                  packed_recent_bytes, recent_blocks, size_kv_cache)
from kvslim.plan.parameters import parameter_counts
from kvslim.plan.published import builtin_config

# Bits per stored element, by the planner's names (int4 packs two elements per byte).
STORAGE_BITS = {d.short: d.bits for d in DTYPES}
DEFAULT_CONTEXT = 4096
# The KV dtypes the engine stores with per-token scales, by the names the planner gives them.
SCALED_KV_DTYPES = tuple(ENGINE_KV_DTYPES)


def parse_storage_dtype(name: str, flag: str = "--dtype") -> str:
    entry = lookup(name)
    if entry is None:
        raise KvslimError(f"{flag}: unknown dtype {name!r}; choose one of "
                          + ", ".join(STORAGE_BITS))
    return entry.short


def storage_bytes(num_elements: int, dtype: str) -> int:
    """Bytes for `num_elements` of `dtype`, rounded up to a whole byte (int4)."""
    return -(-num_elements * STORAGE_BITS[dtype] // 8)


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str, num_kv_heads: int | None = None,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """K/V bytes per token, all layers, in the planner's `kv_dtype`, by the rule the engine
    allocates with (`ModelConfig.kv_storage_bytes_per_token`): fp8 and int8 with their scales;
    int4 and int2 as the engine packs them, a block's parameters over its `block_size` tokens
    (`ModelConfig.kv_cache_block_bytes`). `num_kv_heads`: the same model with that many KV
    heads in every layer."""
    if packed_kv_bits(kv_dtype):
        shaped = config if num_kv_heads is None else replace(
            config, num_key_value_heads=num_kv_heads, layer_kv_heads=None, mla=None)
        return shaped.kv_cache_bytes_per_token(kv_dtype, block_size)
    return config.kv_storage_bytes_per_token(STORAGE_BITS[kv_dtype], kv_dtype in SCALED_KV_DTYPES,
                                             num_kv_heads)


# ---- KV arithmetic -----------------------------------------------------------------------------
@dataclass
class KVLayout:
    """One way to cache K and V for a model: `elements_per_token` over all layers."""
    name: str                          # "MHA", "GQA", "MQA" or "MLA"
    label: str                         # e.g. "GQA, 8 KV heads (this model)"
    elements_per_token: int
    num_kv_heads: int | None           # per layer, for an equivalent; None: the model's own
    is_model: bool = False             # the layout the model really uses


def kv_layouts(config: ModelConfig) -> list[KVLayout]:
    """The model's own layout between its MHA equivalent (one KV head per query head) and its MQA
    equivalent (one KV head), widest first. Elements come from `ModelConfig.kv_elements_per_token`,
    the formula the engine allocates its cache with."""
    heads = config.num_attention_heads
    kind = config.attention_kind
    own_label = (f"MLA, latent {config.mla.kv_lora_rank} + RoPE key {config.mla.qk_rope_head_dim}"
                 if config.mla else f"{kind}, {_kv_heads_label(config)}")
    layouts = [KVLayout(kind, own_label + " (this model)", config.kv_elements_per_token(), None,
                        True)]
    if kind != "MHA":
        layouts.insert(0, KVLayout("MHA", f"MHA equivalent, {heads} KV heads",
                                   config.kv_elements_per_token(heads), heads))
    if kind != "MQA":
        layouts.append(KVLayout("MQA", "MQA equivalent, 1 KV head", config.kv_elements_per_token(1),
                                1))
    return layouts


def _kv_heads_label(config: ModelConfig) -> str:
    heads = config.kv_heads_per_layer
    if config.layer_kv_heads is None:
        return f"{heads[0]} KV heads"
    return f"{' '.join(map(str, heads))} KV heads per layer"


@dataclass
class Capacity:
    """What a KV budget holds, in the engine's whole blocks."""
    kv_budget_bytes: int
    bytes_per_block: int
    num_blocks: int
    max_tokens: int
    max_sequences: int                 # of `context` tokens each


def kv_capacity(kv_budget_bytes: int, bytes_per_token: int, block_size: int, context: int,
                windows: tuple[int | None, ...] = (None,)) -> Capacity:
    """The engine's own sizing, its `KVCachePlan` (`kv_cache/plan.py`): num_blocks = budget //
    bytes_per_block, where a block (page) holds one KV-cache group's layers (`windows` has one
    entry per group, each group a 1/len(windows) share of `bytes_per_token`); a sequence of
    `context` tokens holds ceil(context / block_size) blocks in each full group and those its
    window still sees in each window group. max_tokens: the token slots of one group."""
    plan = size_kv_cache(KVCacheGroups.of_windows(windows), block_size, bytes_per_token,
                         kv_budget_bytes)
    return Capacity(max(0, kv_budget_bytes), plan.bytes_per_block, plan.num_blocks,
                    plan.max_tokens, plan.max_sequences(context))


@dataclass
class KVGroupPlan:
    """One KV-cache group: what a sequence of `context` tokens holds in it."""
    layers: list[int]
    window: int | None                 # None: keeps every block
    bytes_per_token: int               # the group's layers, this model's layout
    blocks_per_sequence: int           # what the engine holds between steps
    bytes: int                         # those blocks, x batch


def kv_group_plans(config: ModelConfig, per_token: int, context: int, batch: int,
                   block_size: int) -> list[KVGroupPlan]:
    """Per group, its blocks and bytes at `context` (groups hold equal bytes per token)."""
    groups = kv_cache_groups(config).groups
    share = per_token // len(groups)
    plans = []
    for group in groups:
        blocks = blocks_held(context, group.window, block_size)
        plans.append(KVGroupPlan(list(group.layers), group.window, share, blocks,
                                 blocks * block_size * share * batch))
    return plans


def held_kv_bytes(config: ModelConfig, per_token: int, context: int, batch: int,
                  block_size: int) -> int:
    """KV bytes for `batch` sequences of `context` tokens: every token in the full groups (as
    bytes, not whole blocks), the blocks the window still sees in the window groups."""
    total = 0
    for plan in kv_group_plans(config, per_token, context, batch, block_size):
        held = context if plan.window is None else min(context, plan.blocks_per_sequence
                                                       * block_size)
        total += plan.bytes_per_token * held * batch
    return total


# ---- the plan ----------------------------------------------------------------------------------
@dataclass
class LayoutPlan:
    name: str
    label: str
    is_model: bool
    kv_elements_per_token: int
    kv_bytes_per_token: int
    kv_bytes: int                      # for context x batch
    capacity: Capacity | None = None


@dataclass
class MemoryPlan:
    model: ModelConfig
    num_parameters: int
    num_active_parameters: int
    weights_dtype: str
    kv_dtype: str
    context: int
    batch: int
    block_size: int
    weight_bytes: int
    kv_bytes_per_token: int            # this model's layout
    kv_bytes: int                      # this model's layout, context x batch
    layouts: list[LayoutPlan]
    memory_bytes: int | None = None    # the device budget, if given
    kv_groups: list[KVGroupPlan] = field(default_factory=list)   # this model's layout
    notes: list[str] = field(default_factory=list)

    @property
    def free_bytes(self) -> int | None:
        """Budget left for the KV cache once the weights are in."""
        return None if self.memory_bytes is None else self.memory_bytes - self.weight_bytes

    def layout(self, name: str) -> LayoutPlan:
        return next(lp for lp in self.layouts if lp.name == name)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["model"] = model_dict(self.model)
        data["free_bytes"] = self.free_bytes
        return data


# What `kvslim memory --json` shows of the model: its name, where the shapes come from, and the
# fields that decide its bytes.
MODEL_FIELDS = ("name", "source", "architecture", "num_hidden_layers", "hidden_size",
                "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings", "torch_dtype",
                "qkv_bias", "o_bias", "mlp_bias", "sliding_window")


def model_dict(config: ModelConfig) -> dict[str, Any]:
    data = {name: getattr(config, name) for name in MODEL_FIELDS}
    data["moe"] = asdict(config.moe) if config.moe else None
    data["mla"] = asdict(config.mla) if config.mla else None
    data["attention_kind"] = config.attention_kind
    return data


def plan_memory(config: ModelConfig, context: int = DEFAULT_CONTEXT, batch: int = 1,
                dtype: str | None = None, kv_dtype: str | None = None,
                memory_bytes: int | None = None, block_size: int | None = None
                ) -> MemoryPlan:
    """`dtype` (weights) defaults to the checkpoint's dtype; `kv_dtype` to the weights' dtype when
    that is a float type, else fp16 (quantized-weight runtimes keep a 16-bit cache);
    `block_size` to the engine's for that KV dtype."""
    if block_size is None:
        packed = packed_kv_bits((lookup(kv_dtype) or lookup("fp16")).name) if kv_dtype else None
        block_size = PACKED_BLOCK_SIZE if packed else DEFAULT_BLOCK_SIZE
    for flag, value in (("--context", context), ("--batch", batch), ("--block-size", block_size)):
        if not isinstance(value, int) or value <= 0:
            raise KvslimError(f"{flag} must be a positive integer, got {value}")
    if memory_bytes is not None and memory_bytes <= 0:
        raise KvslimError(f"--memory must be positive, got {memory_bytes} bytes")
    dtype = parse_storage_dtype(dtype or config.torch_dtype, "--dtype")
    default_kv = dtype if dtype in ("fp32", "fp16", "bf16") else "fp16"
    kv_dtype = parse_storage_dtype(kv_dtype or default_kv, "--kv-dtype")
    total, active = parameter_counts(config)
    weight_bytes = storage_bytes(total, dtype)
    windows = kv_cache_groups(config).windows
    layouts = []
    for layout in kv_layouts(config):
        per_token = kv_bytes_per_token(config, kv_dtype, layout.num_kv_heads, block_size)
        capacity = None if memory_bytes is None else \
            kv_capacity(memory_bytes - weight_bytes, per_token, block_size, context, windows)
        layouts.append(LayoutPlan(layout.name, layout.label, layout.is_model,
                                  layout.elements_per_token, per_token,
                                  held_kv_bytes(config, per_token, context, batch, block_size),
                                  capacity))
    own = next(lp for lp in layouts if lp.is_model)
    plan = MemoryPlan(config, total, active, dtype, kv_dtype, context, batch, block_size,
                      weight_bytes, own.kv_bytes_per_token, own.kv_bytes, layouts, memory_bytes,
                      kv_group_plans(config, own.kv_bytes_per_token, context, batch, block_size))
    plan.notes = _notes(plan)
    return plan


def _notes(plan: MemoryPlan) -> list[str]:
    config, notes = plan.model, []
    if plan.context > config.max_position_embeddings:
        notes.append(f"context {plan.context:,} is beyond the model's "
                     f"{config.max_position_embeddings:,} positions")
    windowed = [g for g in plan.kv_groups if g.window is not None]
    if windowed and windowed[0].window < plan.context:
        layers = sum(len(g.layers) for g in windowed)
        notes.append(f"sliding window {windowed[0].window:,} on {layers} of "
                     f"{config.num_hidden_layers} layers: the engine releases their blocks "
                     f"that fell out of the window, so they hold "
                     f"{windowed[0].blocks_per_sequence} blocks per sequence at any context "
                     "(KV bytes here count that)")
    elif config.sliding_window and config.sliding_window < plan.context:
        notes.append(f"sliding window {config.sliding_window:,}: these layers cannot share "
                     "block tables with the others (their KV heads differ), so the engine "
                     "keeps every block and the window only masks")
    if plan.free_bytes is not None and plan.free_bytes <= 0:
        notes.append("the weights alone exceed --memory: nothing is left for the KV cache")
    if config.moe:
        notes.append(f"MoE: all {config.moe.num_experts} experts are resident (weight bytes); "
                     f"{config.moe.num_experts_per_tok} run per token "
                     f"({plan.num_active_parameters:,} active parameters)")
    if plan.kv_dtype in SCALED_KV_DTYPES:
        notes.append(f"{plan.kv_dtype} KV includes a float16 scale per token and KV head, as "
                     "kvslim's engine stores it (--kv-cache-dtype)")
    elif packed_kv_bits(plan.kv_dtype):
        recent = packed_recent_bytes(plan.model, plan.block_size, 1,
                                     recent_blocks(None, plan.kv_dtype))
        notes.append(f"{plan.kv_dtype} KV as kvslim's engine packs it: keys per channel over "
                     f"each block of {plan.block_size} tokens, values per token in groups, "
                     f"float16 scales and minimums included; each running sequence also "
                     f"keeps its block being filled in float16 ({recent:,} bytes)")
    return notes


def kv_curve(plan: MemoryPlan, contexts: list[int]) -> dict[str, list[int]]:
    """KV bytes (for `plan.batch` sequences) at each context, per layout name."""
    return {lp.name: [held_kv_bytes(plan.model, lp.kv_bytes_per_token, c, plan.batch,
                                    plan.block_size) for c in contexts]
            for lp in plan.layouts}


# ---- showing it --------------------------------------------------------------------------------
def format_bytes(n: int, binary: bool = False) -> str:
    """3 significant digits in decimal (kB, MB, GB = 10^3, 10^6, 10^9) or binary (KiB, MiB, GiB =
    2^10, 2^20, 2^30) units; the two differ by 7.4% at GB scale, which is why both are shown."""
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else \
        (1000, ("B", "kB", "MB", "GB", "TB"))
    value, unit = float(n), units[0]
    for unit in units:
        if abs(value) < base - 0.5 or unit == units[-1]:
            break
        value /= base
    if unit == "B":
        return f"{n:,} B"
    decimals = 0 if value >= 99.95 else 1 if value >= 9.995 else 2   # 3 significant digits
    return f"{value:.{decimals}f} {unit}"


def both_units(n: int) -> str:
    return f"{format_bytes(n)} ({format_bytes(n, binary=True)})"


def table_contexts(plan: MemoryPlan) -> list[int]:
    """Powers of two from 1K up to the model's context length, that length itself, and the
    requested context."""
    top = plan.model.max_position_embeddings
    contexts = {c for c in (2 ** k for k in range(10, 21)) if c <= top}
    return sorted(contexts | {top, plan.context})


def markdown_table(plan: MemoryPlan) -> str:
    """KV bytes vs context for each layout, as a markdown table (GB = 10^9 bytes)."""
    contexts = table_contexts(plan)
    curve = kv_curve(plan, contexts)
    names = [lp.name + (" (this model)" if lp.is_model else " equivalent") for lp in plan.layouts]
    lines = [f"| context | " + " | ".join(names) + " |",
             "|---:|" + "---:|" * len(names)]
    for i, c in enumerate(contexts):
        cells = [format_bytes(curve[lp.name][i]) for lp in plan.layouts]
        lines.append(f"| {c:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_kv(plan: MemoryPlan, path: str | Path) -> Path:
    """PNG of KV bytes vs context: the model as MHA / its own layout / MQA, and DeepSeek-V2's MLA
    for comparison; the budget left after the weights as a line when --memory is given."""
    try:
        import matplotlib
    except ImportError:
        raise KvslimError("--plot needs matplotlib: pip install matplotlib==3.11.2 (the lab, "
                          "pip install -e ./lab, brings it)") from None
    matplotlib.use("Agg")                  # no display needed; writes files only
    import matplotlib.pyplot as plt

    top = max(plan.model.max_position_embeddings, plan.context)
    contexts = [round(top * i / 200) for i in range(1, 201)]
    fig, ax = plt.subplots(figsize=(8, 6), dpi=120)
    for name, values in kv_curve(plan, contexts).items():
        lp = plan.layout(name)
        ax.plot(contexts, [v / 1e9 for v in values], lw=2.5 if lp.is_model else 1.5,
                label=f"{lp.label}: {format_bytes(lp.kv_bytes_per_token)}/token")
    if not plan.model.mla:
        mla = plan_memory(builtin_config("DeepSeek-V2"), plan.context, plan.batch,
                          kv_dtype=plan.kv_dtype)
        ax.plot(contexts, [mla.kv_bytes_per_token * c * plan.batch / 1e9 for c in contexts],
                ls="--", label=f"DeepSeek-V2 MLA (another model, for scale): "
                               f"{format_bytes(mla.kv_bytes_per_token)}/token")
    if plan.free_bytes is not None and plan.free_bytes > 0:
        ax.axhline(plan.free_bytes / 1e9, color="black", ls=":",
                   label=f"--memory minus weights: {format_bytes(plan.free_bytes)}")
    ax.axvline(plan.context, color="grey", lw=0.8)
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel(f"KV cache, GB (10^9 bytes), batch {plan.batch}")
    ax.set_title(f"{plan.model.name}: KV cache in {plan.kv_dtype}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, frameon=False)
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise KvslimError(f"cannot write plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
