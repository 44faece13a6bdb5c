"""`KVCachePlan`: the paged KV cache's size, computed once from the model's config and the
engine's options: its dtype, its KV-cache groups and their windows, the bytes of one block id
(a page: K and V of `block_size` tokens in one group's layers), the blocks the budget holds,
the longest sequence one request may have (max_model_len) and how many sequences of a context
fit at once.

Everything that sizes the cache reads it: the CLI's checks before any weights load (from
config.json), the model runner (which allocates exactly `num_blocks` such pages), the draft
model's own cache, each tensor-parallel rank (on its shard's shapes) and `kvslim memory`
(plan/memory.py: every layout it prices goes through `size_kv_cache`). Plain Python, as the
groups' arithmetic (`groups.py`) it builds on."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvslim.errors import KvslimError
from kvslim.kv_cache.groups import KVCacheGroups, blocks_held, kv_cache_groups, longest_sequence
from kvslim.models.config import ModelConfig
from kvslim.dtypes import DTYPES, packed_kv_bits

DEFAULT_BLOCK_SIZE = 16    # tokens per block: the engine's default and the planner's
# A packed 4-/2-bit cache's default: its keys' scale and minimum per channel are shared by a
# block's tokens, and its block being filled stays in float16 (measured on SmolLM2 through the
# cache, docs/kv-cache-compression.md: 64 keeps int4 within 1% of float at 1.83x int8's
# token slots; 16 loses less but holds 1.5x).
PACKED_BLOCK_SIZE = 64

# `--kv-pressure demote` (engine/kv_demotion.py): int8 blocks in the bytes of one float32 block,
# each with a float16 scale per token and KV head in a tensor of their own.
DEMOTED_PER_BLOCK = 4

# The planner's names (`kvslim memory --kv-dtype`, plan/memory.py) for the engine's quantized
# KV-cache dtypes (`--kv-cache-dtype`): the caches stored with a float16 scale per token and KV
# head.
ENGINE_KV_DTYPES = {d.short: d.name for d in DTYPES if d.kv_quantized}


@dataclass(frozen=True)
class KVPool:
    """The blocks of one storage precision under a per-layer KV plan: the groups that store in
    it draw its block ids, [first_block, first_block + num_blocks), and only those."""
    kv_dtype: Any                       # the engine's torch dtype, or a packed one's name
    groups: tuple[int, ...]             # indices into KVCacheGroups.groups
    bytes_per_block: int                # one page: one group's layers in this precision
    num_blocks: int
    first_block: int = 0


@dataclass(frozen=True)
class KVCachePlan:
    kv_dtype: Any                       # the engine's torch dtype; the planner's name ("fp16")
    groups: KVCacheGroups               # one block table per group; windows release blocks
    block_size: int
    bytes_per_block: int                # one block id (page): one group's layers, scales included
    num_blocks: int                     # whole blocks the budget holds
    # The engine's: the model's context capped by what the cache holds for one sequence (None
    # in the planner, which prices contexts instead).
    max_model_len: int | None = None
    # A per-layer KV plan's pools, one per precision (empty: one pool of every group, the
    # fields above) and the context the plan's capacity is counted in.
    layer_pools: tuple[KVPool, ...] = ()
    plan_context: int | None = None

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.groups.windows

    @property
    def pools(self) -> tuple[KVPool, ...]:
        return self.layer_pools or (KVPool(self.kv_dtype, tuple(range(len(self.groups.groups))),
                                           self.bytes_per_block, self.num_blocks),)

    @property
    def max_tokens(self) -> int:
        """Token slots of one group: what a model with one group holds in all; under a
        per-layer plan, the tokens of the plan's context its sequences hold at once."""
        if self.layer_pools:
            return self.max_sequences(self.plan_context) * self.plan_context
        return self.num_blocks * self.block_size // len(self.groups.groups)

    @property
    def bytes_per_token(self) -> int:
        """Every layer's bytes per token (a page holds one group's layers)."""
        return sum(p.bytes_per_block * len(p.groups) for p in self.pools) // self.block_size

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes_per_block * p.num_blocks for p in self.pools)

    def blocks_per_sequence(self, context: int, pool: KVPool | None = None) -> int:
        """Blocks a sequence of `context` tokens holds between steps, over every group (of
        `pool`, when given)."""
        groups = (self.groups.groups if pool is None
                  else [self.groups.groups[g] for g in pool.groups])
        return sum(blocks_held(context, g.window, self.block_size, g.sinks) for g in groups)

    def max_sequences(self, context: int) -> int:
        """Sequences of `context` tokens that fit at once (in every pool)."""
        return min(p.num_blocks // self.blocks_per_sequence(context, p) for p in self.pools)

    def longest_sequence(self, chunk: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) that fits during any step computing up
        to `chunk` tokens (`groups.longest_sequence`), in every pool."""
        groups = self.groups.groups
        return min(longest_sequence(p.num_blocks, tuple(groups[g].window for g in p.groups),
                                    self.block_size, chunk, limit,
                                    tuple(groups[g].sinks for g in p.groups))
                   for p in self.pools)


def size_kv_cache(groups: KVCacheGroups, block_size: int, bytes_per_token: int, budget: int,
                  kv_dtype: Any = None, block_bytes: int | None = None) -> KVCachePlan:
    """Whole blocks of `budget` bytes. `bytes_per_token`: one token in every layer, scales
    included; a page holds one group's share of it for `block_size` tokens (the shares are
    equal: position j of every group has the same KV heads, `kv_cache_groups`). `block_bytes`:
    a block of every layer exactly, where a block carries more than its tokens (a packed
    cache's key parameters). No minimum here: the planner shows a budget that holds no block."""
    block_bytes = block_bytes or block_size * bytes_per_token
    bytes_per_block = block_bytes // len(groups.groups)
    return KVCachePlan(kv_dtype, groups, block_size, bytes_per_block,
                       max(0, budget) // bytes_per_block)


def plan_kv_cache(config: ModelConfig, kv_dtype, options, num_blocks: int | None = None,
                  max_model_len: int | None = None, pool_dtypes: dict | None = None
                  ) -> KVCachePlan:
    """The engine's plan for a model of `config` (a tensor-parallel rank's shapes: its share of
    the KV heads) with its cache stored in `kv_dtype` (a torch dtype, "auto" resolved).
    `options`: the engine's options (an EngineConfig; kv_cache_memory, block_size,
    max_num_batched_tokens, max_model_len, keep_out_of_window_blocks are read). `num_blocks`
    and `max_model_len`, when given, size a cache to match another one (the draft model's, the
    other ranks') instead of the budget. KvslimError when one block does not fit in
    kv_cache_memory, or max_model_len asks for more than the cache holds. Under a per-layer KV
    plan (options.layer_plan) each precision gets a pool (`_pooled_plan`); `pool_dtypes`:
    each plan precision's storage dtype resolved ("auto": the model's)."""
    layer_plan = getattr(options, "layer_plan", None)
    groups = kv_cache_groups(config, not options.keep_out_of_window_blocks,
                             getattr(options, "window", None), layer_plan)
    bs, budget = options.block_size, options.kv_cache_memory
    if layer_plan is not None:
        plan = _pooled_plan(config, groups, options, pool_dtypes or {}, layer_plan.context)
        kv_dtype = plan.kv_dtype
    elif packed_kv_bits(kv_dtype):      # the recent blocks come out of the same budget
        budget -= packed_recent_bytes(config, bs, recent_rows(options),
                                      recent_blocks(options, kv_dtype))
    if layer_plan is None:
        demoted = demoted_scale_bytes(config) if getattr(options, "kv_pressure", "") == \
            "demote" else 0
        plan = size_kv_cache(groups, bs, config.kv_cache_bytes_per_token(kv_dtype, bs) + demoted,
                             budget, kv_dtype,
                             config.kv_cache_block_bytes(kv_dtype, bs) + bs * demoted)
    if num_blocks is not None:
        plan = replace(plan, num_blocks=num_blocks)
    elif min(p.num_blocks for p in plan.pools) < 1:
        raise KvslimError(
            f"kv_cache_memory={options.kv_cache_memory} bytes is too small for one block of "
            f"{options.block_size} tokens ({max(p.bytes_per_block for p in plan.pools)} "
            f"bytes for this model)")
    if max_model_len is None:
        max_model_len = _max_model_len(plan, config, options)
    return replace(plan, max_model_len=max_model_len)


def _pooled_plan(config: ModelConfig, groups: KVCacheGroups, options, dtypes: dict,
                 context: int) -> KVCachePlan:
    """A per-layer plan's cache: one pool per precision, the budget (less the packed pools'
    recent rows) split by what a sequence of the plan's `context` holds in each, so that the
    plan's sequences run out of every pool at once."""
    from kvslim.kv_cache.budget import layer_bytes_per_token
    bs, n_layers = options.block_size, config.num_hidden_layers
    budget, pools = options.kv_cache_memory, []
    for name in groups.precisions:
        members = tuple(i for i, g in enumerate(groups.groups) if g.precision == name)
        dtype = dtypes.get(name, name)
        page = round(bs * sum(layer_bytes_per_token(config, layer, dtype, bs)
                              for layer in groups.groups[members[0]].layers))
        held = page * sum(blocks_held(context, groups.groups[g].window, bs,
                                      groups.groups[g].sinks) for g in members)
        if packed_kv_bits(dtype):
            budget -= packed_recent_bytes(config, bs, recent_rows(options),
                                          recent_blocks(options, dtype)
                                          ) * len(members) * groups.group_size // n_layers
        pools.append((dtype, members, page, held))
    total = sum(p[3] for p in pools)
    first, sized = 0, []
    for dtype, members, page, held in pools:
        n = max(0, budget) * held // total // page
        sized.append(KVPool(dtype, members, page, n, first))
        first += n
    used = sum(p.num_blocks * p.bytes_per_block for p in sized)
    return KVCachePlan(dtypes.get("auto", sized[0].kv_dtype), groups, bs,
                       used // max(first, 1), first, layer_pools=tuple(sized),
                       plan_context=context)


def demoted_scale_bytes(config: ModelConfig) -> int:
    """Bytes per token of the scales of the int8 blocks a float32 block's bytes may hold
    under `--kv-pressure demote`: float16, K and V, per KV head, every layer."""
    return DEMOTED_PER_BLOCK * 2 * 2 * sum(config.kv_heads_per_layer)


def packed_recent_bytes(config: ModelConfig, block_size: int, rows: int, blocks: int) -> int:
    """A packed cache's recent rows (attention/lowbit_cache.py): `blocks` blocks of K and V in
    float16 per sequence row, every layer."""
    from kvslim.attention.lowbit_cache import RECENT_DTYPE
    return rows * blocks * block_size * config.kv_bytes_per_token(RECENT_DTYPE)


def recent_rows(options) -> int:
    """Sequences a packed cache keeps recent blocks for: one per block-table row the runner
    has (engine/block_table.py: max_num_seqs)."""
    return options.max_num_seqs


def recent_blocks(options, kv_dtype) -> int:
    """Blocks of recent rows per sequence of a packed cache (kernels/lowbit_codes.py)."""
    from kvslim.attention.lowbit_cache import recent_blocks as blocks
    return blocks(packed_kv_bits(kv_dtype), getattr(options, "speculative", None) is not None)


def _max_model_len(plan: KVCachePlan, config: ModelConfig, options) -> int:
    """The model's context, capped by what the KV cache can hold for one sequence (a user who
    asks for more than the cache holds gets an error instead)."""
    positions = config.max_position_embeddings
    if (options.max_model_len or 0) > positions and getattr(options, "window", None) \
            and not config.positions_past_context:
        raise KvslimError(
            f"max_model_len={options.max_model_len} is past the model's {positions} positions, "
            f"which its {config.rope_scaling['rope_type']} RoPE factors were fitted for: a "
            f"window runs past them only where RoPE's frequencies do not depend on the context")
    capacity = plan.longest_sequence(options.max_num_batched_tokens,
                                     max(positions, options.max_model_len or 0))
    if options.max_model_len is not None:
        if capacity and options.max_model_len > capacity:
            raise KvslimError(
                f"max_model_len={options.max_model_len} needs more KV cache than "
                f"kv_cache_memory={options.kv_cache_memory} bytes holds ({capacity} "
                f"tokens); raise kv_cache_memory or lower max_model_len")
        return options.max_model_len
    return max(1, min(positions, capacity))
