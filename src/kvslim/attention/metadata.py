"""What paged attention reads for one engine step, and the one place that builds it.

The model runner lays out the step (`PagedStepLayout`: where each new token's K/V goes, which
blocks each decode reads, the prefill chunks); `build_paged_metadata` turns that layout into
`PagedAttentionMetadata` once per step: the layout plus everything derived from it (the decode
mask or the lone-decode length, each chunk's causal mask). `PagedAttention` only reads it, so
every layer of the step shares one copy and the special cases are decided here, not per layer.

The layout is split from the metadata because the CUDA-graph decode path needs only the layout
(it copies it into static buffers and builds its own graph-safe metadata from those): deriving
masks for it, or reading a length back to the host, would be wasted work on the hot path."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvslim.attention.grouped import causal_mask
from kvslim.attention.tree import TreeRows


@dataclass
class PrefillChunk:
    query_start: int          # offset of the chunk in the step's flat tokens
    query_len: int            # tokens computed this step
    context_len: int          # cached prefix + query_len
    block_table: torch.Tensor  # [num_blocks] block ids covering the context (from key_start)
    key_start: int = 0        # position of the table's first key (a multiple of block_size)
    tree: TreeRows | None = None   # the rows are a tree of drafts, not consecutive tokens

    @property
    def start(self) -> int:
        """Slot position of the chunk's first row (a tree's root)."""
        return self.context_len - self.query_len


@dataclass
class PagedStepLayout:
    """The step's flat tokens: first the decodes (one token each), then the prefill chunks."""
    slot_mapping: torch.Tensor                 # [num_tokens] cache slot of each new token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    decode_key_start: int = 0  # position of the tables' first key (a multiple of block_size)
    prefills: list[PrefillChunk] = field(default_factory=list)
    recent: Any = None         # a packed cache's RecentRows (lowbit_cache.py), else None


@dataclass(frozen=True)
class PagedAttentionMetadata:
    layout: PagedStepLayout
    decode_allowed: torch.Tensor | None        # [num_decodes, 1, max_len] bool, or None
    prefill_allowed: list[torch.Tensor | None]  # per chunk [1, query_len, context_len], or None
    sliding_window: int | None = None          # the layers' window (the decode kernel's)
    sink_tokens: int = 0                       # the first positions seen past the window


def build_paged_metadata(layout: PagedStepLayout, block_size: int,
                         sliding_window: int | None = None,
                         sink_tokens: int = 0) -> PagedAttentionMetadata:
    """Every decode, a lone one too, attends over its whole blocks with a mask: a sequence's
    numbers never depend on the batch's widest table (SDPA over whole blocks gives the same bits
    for any padding; over exactly its keys, others: tests/attention/test_paged.py).
    sink_tokens: with a window, the first positions every query also sees
    (kv_cache/window.py)."""
    decode_allowed = None
    if layout.num_decode_tokens:
        decode_allowed = _decode_allowed(layout, block_size, sliding_window, sink_tokens)
    device = layout.slot_mapping.device
    return PagedAttentionMetadata(
        layout=layout, decode_allowed=decode_allowed,
        prefill_allowed=[_prefill_allowed(p, device, sliding_window, sink_tokens)
                         for p in layout.prefills],
        sliding_window=sliding_window, sink_tokens=sink_tokens)


def _decode_allowed(layout: PagedStepLayout, block_size: int, sliding_window: int | None,
                    sinks: int) -> torch.Tensor:
    """Each decode sees the keys before its length (and inside its window or among its
    sinks), out of the padded width of the block tables."""
    width = layout.decode_block_tables.shape[1] * block_size
    start = layout.decode_key_start
    key_pos = torch.arange(start, start + width, device=layout.slot_mapping.device)[None, :]
    lens = layout.decode_context_lens[:, None]
    allowed = key_pos < lens
    if sliding_window is not None:
        allowed &= (key_pos >= lens - sliding_window) | (key_pos < sinks)
    return allowed[:, None, :]       # [B, Tq=1, Tk]


def _prefill_allowed(chunk: PrefillChunk, device: torch.device, sliding_window: int | None,
                     sinks: int) -> torch.Tensor | None:
    if chunk.tree is not None:
        return tree_allowed(chunk, device, sliding_window, sinks)[None]
    # A chunk with nothing cached before it and no window is plain causal attention: no mask.
    if chunk.query_len == chunk.context_len and sliding_window is None:
        return None
    return causal_mask(chunk.query_len, chunk.context_len, device, sliding_window,
                       chunk.key_start, sinks)[None]


def build_layer_metadata(layouts: PagedStepLayout | list[PagedStepLayout], block_size: int,
                         layer_windows: list[int | None], layer_group: list[int] | None = None,
                         layer_sinks: list[int] | None = None) -> list[PagedAttentionMetadata]:
    """Per layer, the metadata of its window (and sinks) over its KV-cache group's layout
    (`layouts[g]`; one layout serves every layer when the cache has one group). A model that
    mixes local and global layers builds one per group."""
    sinks_of = dict(zip(layer_windows, layer_sinks or [0] * len(layer_windows)))
    return share_per_layer(layouts, layer_windows, layer_group,
                           lambda layout, group, window: build_paged_metadata(
                               layout, block_size, window, sinks_of[window]))


def share_per_layer(layouts: PagedStepLayout | list[PagedStepLayout],
                    layer_windows: list[int | None], layer_group: list[int] | None,
                    build: Callable[[PagedStepLayout, int, int | None], Any]) -> list:
    """Per layer, `build(layout of its group, group, window)`, called once per distinct
    (group, window) and shared by the layers that have it (every backend's metadata is built
    this way: the layers of one step never rebuild what another layer has). A window has one
    sink count (kv_cache/window.py: the sinks come with the engine's window only)."""
    if isinstance(layouts, PagedStepLayout):
        layouts = [layouts]
    layer_group = layer_group or [0] * len(layer_windows)
    keys = list(zip(layer_group, layer_windows))
    built = {(g, w): build(layouts[g], g, w) for g, w in dict.fromkeys(keys)}
    return [built[key] for key in keys]


def tree_allowed(chunk: PrefillChunk, device: torch.device, sliding_window: int | None,
                 sinks: int = 0) -> torch.Tensor:
    """[rows, keys] bool for a tree chunk: each row sees the keys before the chunk (inside the
    window of its own position, start + depth, or among the sinks) and its ancestors. A window
    is longer than any tree (SpeculativeConfig), so a row's ancestors are always inside it."""
    tree = chunk.tree
    keys = torch.arange(chunk.key_start, chunk.start, device=device)[None, :]
    prefix = torch.ones(len(tree), keys.shape[1], dtype=torch.bool, device=device)
    if sliding_window is not None:
        depth = torch.tensor(tree.depths, device=device)[:, None]
        prefix &= (keys > chunk.start + depth - sliding_window) | (keys < sinks)
    return torch.cat([prefix, tree.ancestors(device)], dim=1)
