"""KV-cache groups: which layers share a block table, so that sliding-window layers can give
back the blocks that fell out of their window while global layers keep every block.

As in vLLM's hybrid KV-cache manager, layers are grouped by attention type (their window), and
every group has the same number of layers, `group_size` (the gcd of the types' layer counts:
Gemma 3 270M's 15 local + 3 global layers make 5 local groups and 1 global group of 3). A block
id (a *page*) then means one block of `group_size` layers; position j of every group shares one
storage tensor, and whichever group holds a page writes its layers there. All groups draw pages
from one pool, so the budget never has to be split between local and global layers in advance.

A sequence holds one block table per group. A global group's table covers every token; a window
group's table keeps only the blocks its next query can still see (`first_needed_block`), the
entries before are released (`NULL_BLOCK`), so its pages stop growing with the context.

Plain Python: the engine's block manager, its model runner and the memory planner all size the
cache from here (`plan.py`'s `KVCachePlan`), so they agree by construction."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvslim.errors import KvslimError
from kvslim.kv_cache.window import KVWindow, LayerSpan, layer_spans, sink_blocks
from kvslim.models.config import ModelConfig

NULL_BLOCK = -1          # a window group's released entry: no page behind it


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]
    # Blocks entirely older than this many tokens before the next query are released; None:
    # the group keeps every block (full attention, or freeing switched off).
    window: int | None
    # The first positions the window group keeps however far its window moves (kv_window.py).
    sinks: int = 0
    # Its layers' storage under a per-layer KV plan (layer_plan.py; one pool per precision,
    # plan.py), None: the engine's kv_cache_dtype.
    precision: str | None = None


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]

    @classmethod
    def of_windows(cls, windows: tuple[int | None, ...]) -> "KVCacheGroups":
        """Groups known by their windows alone (their layers unnamed): enough to size a cache,
        which reads only the windows (the planner's `kv_capacity`)."""
        return cls(tuple(KVCacheGroup((), w) for w in windows))

    @property
    def group_size(self) -> int:
        return len(self.groups[0].layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def sinks(self) -> tuple[int, ...]:
        return tuple(g.sinks for g in self.groups)

    @property
    def precisions(self) -> tuple[str | None, ...]:
        """The distinct storage precisions, in group order: one pool each (plan.py)."""
        return tuple(dict.fromkeys(g.precision for g in self.groups))

    def group_of_layer(self) -> list[int]:
        """Per layer, the index of its group."""
        owner = {layer: g for g, group in enumerate(self.groups) for layer in group.layers}
        return [owner[layer] for layer in sorted(owner)]

    def position_of_layer(self) -> list[int]:
        """Per layer, its position inside its group: the storage tensor it writes to."""
        pos = {layer: j for group in self.groups for j, layer in enumerate(group.layers)}
        return [pos[layer] for layer in sorted(pos)]


def kv_cache_groups(config: ModelConfig, free_out_of_window: bool = True,
                    kv_window: KVWindow | None = None, layer_plan=None) -> KVCacheGroups:
    """The model's groups, by each layer's span (its window, narrowed by the engine's
    `kv_window`, and its sinks). One group of every layer when all layers share one span (Llama:
    none; Mistral: all windowed, so every layer's old blocks go). `free_out_of_window=False` is
    the mask-only path: one group that keeps every block. Storage position j is shared by the
    j-th layer of each group, so those layers must have equal KV heads; a non-uniform GQA model
    that also mixes windows keeps every block instead (its windows remain masks).
    `layer_plan` (layer_plan.py): each layer's window and storage precision from a plan; layers
    group by both, and every group must be uniform in KV heads by position."""
    layers = range(config.num_hidden_layers)
    spans = layer_spans(config, kv_window, layer_plan)
    precisions = ([s.precision for s in layer_plan.layers] if layer_plan is not None
                  else [None] * len(layers))
    kinds = [(span, p) for span, p in zip(spans, precisions)]
    types: list[tuple[LayerSpan, str | None]] = list(dict.fromkeys(kinds))
    if not free_out_of_window and layer_plan is None:
        return KVCacheGroups((KVCacheGroup(tuple(layers), None),))
    if len(types) == 1:
        (span, p), = types
        return KVCacheGroups((KVCacheGroup(tuple(layers), span.window, span.sinks, p),))
    by_type = {t: [i for i in layers if kinds[i] == t] for t in types}
    size = math.gcd(*(len(ls) for ls in by_type.values()))
    groups = tuple(KVCacheGroup(tuple(ls[i:i + size]), t[0].window, t[0].sinks, t[1])
                   for t, ls in by_type.items() for i in range(0, len(ls), size))
    heads = config.kv_heads_per_layer
    if any(len({heads[g.layers[j]] for g in groups}) > 1 for j in range(size)):
        if layer_plan is not None:
            raise KvslimError("kv_plan: this model's layers differ in KV heads, so its layers "
                              "cannot be grouped by setting; use one setting for all layers")
        return KVCacheGroups((KVCacheGroup(tuple(layers), None),))
    return KVCacheGroups(groups)


def first_needed_block(num_computed_tokens: int, window: int | None, block_size: int) -> int:
    """The first block the next query (at position `num_computed_tokens`) can see: it attends to
    the `window` positions ending at itself."""
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def blocks_held(num_tokens: int, window: int | None, block_size: int, sinks: int = 0) -> int:
    """Blocks one group holds for a sequence of `num_tokens` computed tokens between steps:
    all of them for a full group, those its next query can see for a window group (its sink
    blocks included)."""
    if num_tokens <= 0:
        return 0
    last = (num_tokens - 1) // block_size
    first = min(first_needed_block(num_tokens, window, block_size), last)
    return last - first + 1 + min(sink_blocks(sinks, block_size), first)


def step_blocks(num_tokens: int, window: int | None, block_size: int, chunk: int,
                sinks: int = 0) -> int:
    """The most blocks one group holds for a sequence during a step that computes up to `chunk`
    tokens and ends at `num_tokens`: a window group holds its sink blocks and what the chunk's
    first query sees through the chunk's end."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    return min(full, -(-(window - 1 + chunk) // block_size) + 1 + sink_blocks(sinks, block_size))


def longest_sequence(num_blocks: int, windows: tuple[int | None, ...], block_size: int,
                     chunk: int, limit: int, sinks: tuple[int, ...] | None = None) -> int:
    """The longest sequence (at most `limit` tokens) whose blocks in every group fit in
    `num_blocks` during any step: the full groups grow with it, the window groups do not."""
    sinks = sinks or (0,) * len(windows)

    def fits(n: int) -> bool:
        return sum(step_blocks(n, w, block_size, chunk, s)
                   for w, s in zip(windows, sinks)) <= num_blocks
    lo, hi = 0, limit                        # fits() is monotone in n: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
