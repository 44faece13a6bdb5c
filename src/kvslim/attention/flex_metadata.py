"""What the FlexAttention backend (`flex.py`) reads for one engine step, built once per step.

FlexAttention sees a layer's whole KV pool as one key sequence of pool_blocks * block_size slots
and the step's new tokens as one query sequence; nothing is gathered. Whether query row q may
read pool slot kv is a lookup: the physical block of kv, mapped back to its logical index in
q's sequence (`logical_of`, -1 where that sequence does not hold the block), gives the key's
token position, which must not be after q's (and must be inside q's window, on a window layer).

From the step's layout (the `PagedStepLayout` the gather path reads too) this module builds, once
per layout, `FlexStepTensors`: each token's sequence and position, and every sequence's
block-table entries; then, once per distinct window over it, `FlexAttentionMetadata`: the
inverse map and the block mask, which lists for each tile of Q_TILE query rows the pool blocks
its sequences may read, so the kernel skips every other block of the pool.

Nothing here reads a tensor back to the host: sizes come from the layout's host values (table
widths, chunk lengths), so a step never waits for the device to build its metadata, and the
decode-graph path (decodes only: device tensors and host sizes, no host lists) can record it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvslim.attention.metadata import PagedStepLayout, share_per_layer
from kvslim.device import host_tensor

Q_TILE = 16      # query rows per block-mask tile: the CUDA kernel's BLOCK_M


@dataclass(frozen=True)
class FlexStepTensors:
    """One layout's tensors (tokens in the layout's order: the decodes, then the chunks; the
    sequences likewise), shared by every window over it."""
    slot_mapping: torch.Tensor    # [N] cache slot of each new token
    q_seq: torch.Tensor           # [N] each token's sequence
    q_pos: torch.Tensor           # [N] each token's position
    q_base: torch.Tensor          # [N] it reads keys before this position, then its tree path:
    q_bits: torch.Tensor          # [N] the positions base + i of its set bits (0: no tree)
    seq_first_pos: torch.Tensor   # [S] position of the sequence's first query this step
    seq_num_blocks: torch.Tensor  # [S] logical blocks its context fills after this step
    entry_seq: torch.Tensor       # [E] every block-table entry of the step: its sequence,
    entry_logical: torch.Tensor   # [E] its logical block index
    entry_block: torch.Tensor     # [E] and its physical block
    pair_tile: torch.Tensor       # [T] (query tile, entry) pairs: the tile's rows may read
    pair_entry: torch.Tensor      # [T] that entry's block
    num_seqs: int
    num_tiles: int
    max_tile_blocks: int          # at most this many distinct blocks in one tile's rows

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass(frozen=True)
class FlexAttentionMetadata:
    step: FlexStepTensors
    window: int | None
    logical_of: torch.Tensor      # [S, pool_blocks + 1] int32: logical index of a block, or -1
    block_mask: BlockMask


def build_flex_layer_metadata(layouts: PagedStepLayout | list[PagedStepLayout], block_size: int,
                              pool_blocks: int, layer_windows: list[int | None],
                              layer_group: list[int] | None = None
                              ) -> list[FlexAttentionMetadata]:
    """Per layer, the metadata of its window over its KV-cache group's layout: the step tensors
    once per group, the inverse map and block mask once per distinct (group, window)."""
    steps: dict[int, FlexStepTensors] = {}

    def build(layout: PagedStepLayout, group: int, window: int | None):
        if group not in steps:
            steps[group] = build_flex_step(layout, block_size)
        return build_flex_metadata(steps[group], block_size, pool_blocks, window)
    return share_per_layer(layouts, layer_windows, layer_group, build)


def build_flex_step(layout: PagedStepLayout, block_size: int) -> FlexStepTensors:
    parts = []
    if layout.num_decode_tokens:
        parts.append(_decode_part(layout, block_size))
    if layout.prefills:
        parts.append(_prefill_part(layout, block_size))
    fields = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    nd = layout.num_decode_tokens
    num_tokens = nd + sum(c.query_len for c in layout.prefills)
    decode_width = layout.decode_block_tables.shape[1] if nd else 0
    max_tile_blocks = (min(nd, Q_TILE) * decode_width
                       + sum(c.block_table.shape[0] for c in layout.prefills))
    return FlexStepTensors(slot_mapping=layout.slot_mapping, **fields,
                           num_seqs=nd + len(layout.prefills),
                           num_tiles=-(-num_tokens // Q_TILE), max_tile_blocks=max_tile_blocks)


def _decode_part(layout: PagedStepLayout, block_size: int) -> dict[str, torch.Tensor]:
    """Decode i is token i and sequence i; its table row starts at logical block
    decode_key_start // block_size. Device tensors only (the decode-graph path records this)."""
    tables, lens = layout.decode_block_tables, layout.decode_context_lens
    nd, width = tables.shape
    dev = tables.device
    seqs = torch.arange(nd, device=dev)
    entry_seq = seqs[:, None].expand(nd, width).reshape(-1)
    first = layout.decode_key_start // block_size
    return dict(q_seq=seqs, q_pos=lens - 1, q_base=lens, q_bits=torch.zeros_like(lens),
                seq_first_pos=lens - 1,
                seq_num_blocks=(lens + block_size - 1) // block_size,
                entry_seq=entry_seq,
                entry_logical=torch.arange(first, first + width, device=dev).repeat(nd),
                entry_block=tables.reshape(-1),
                pair_tile=entry_seq // Q_TILE,
                pair_entry=torch.arange(nd * width, device=dev))


def _prefill_part(layout: PagedStepLayout, block_size: int) -> dict[str, torch.Tensor]:
    """Chunk i is sequence num_decodes + i. Its host values go to the device in one copy; its
    tiles (a chunk spans several) pair with its entries through device aranges."""
    dev = layout.slot_mapping.device
    nd = layout.num_decode_tokens
    decode_entries = layout.decode_block_tables.numel() if nd else 0
    q_seq, q_pos, q_base, q_bits, first_pos, num_blocks = [], [], [], [], [], []
    entry_seq, entry_logical = [], []
    blocks, pair_tile, pair_entry = [], [], []
    entry = decode_entries
    for i, chunk in enumerate(layout.prefills):
        start, n = chunk.start, chunk.block_table.shape[0]
        first = chunk.key_start // block_size
        q_seq += [nd + i] * chunk.query_len
        if chunk.tree is None:
            q_pos += range(start, chunk.context_len)
            q_base += range(start + 1, chunk.context_len + 1)
            q_bits += [0] * chunk.query_len
        else:
            q_pos += [start + d for d in chunk.tree.depths]
            q_base += [start] * chunk.query_len
            q_bits += chunk.tree.bits
        first_pos.append(start)
        num_blocks.append(-(-chunk.context_len // block_size))
        entry_seq += [nd + i] * n
        entry_logical += range(first, first + n)
        blocks.append(chunk.block_table)
        lo = chunk.query_start // Q_TILE
        hi = (chunk.query_start + chunk.query_len - 1) // Q_TILE
        tiles = torch.arange(lo, hi + 1, device=dev)
        pair_tile.append(tiles[:, None].expand(-1, n).reshape(-1))
        pair_entry.append(torch.arange(entry, entry + n, device=dev).repeat(hi - lo + 1))
        entry += n
    host = [q_seq, q_pos, q_base, q_bits, first_pos, num_blocks, entry_seq, entry_logical]
    flat = host_tensor([v for values in host for v in values], torch.long, dev)
    names = ("q_seq", "q_pos", "q_base", "q_bits", "seq_first_pos", "seq_num_blocks",
             "entry_seq", "entry_logical")
    out = dict(zip(names, flat.split([len(values) for values in host])))
    return dict(out, entry_block=torch.cat(blocks), pair_tile=torch.cat(pair_tile),
                pair_entry=torch.cat(pair_entry))


def build_flex_metadata(step: FlexStepTensors, block_size: int, pool_blocks: int,
                        window: int | None) -> FlexAttentionMetadata:
    """The inverse map and the block mask of one window over the step. An entry is valid when
    its block holds part of the sequence's context that its first query can see: before the
    context's end, and not entirely before the window (a window group's released entries
    are stale ids or 0, and a reused table row keeps a previous sequence's ids past the end:
    mapping those would point a real block at the wrong logical index)."""
    dev = step.q_seq.device
    first_needed = torch.zeros_like(step.seq_first_pos)
    if window is not None:      # kv_cache.groups.first_needed_block, per sequence
        first_needed = (step.seq_first_pos - window + 1).clamp(min=0) // block_size
    seq = step.entry_seq
    valid = ((step.entry_logical < step.seq_num_blocks[seq])
             & (step.entry_logical >= first_needed[seq]))
    # Invalid entries are written to a spare column (pool_blocks) that no key maps to.
    target = torch.where(valid, step.entry_block, pool_blocks)
    logical_of = torch.full((step.num_seqs, pool_blocks + 1), -1, dtype=torch.int32, device=dev)
    logical_of[seq, target] = step.entry_logical.to(torch.int32)
    width = max(1, min(pool_blocks, step.max_tile_blocks))
    counts, indices = tile_blocks(step.pair_tile, target[step.pair_entry], step.num_tiles,
                                  pool_blocks, width)
    block_mask = BlockMask.from_kv_blocks(
        counts[None, None], indices[None, None], BLOCK_SIZE=(Q_TILE, block_size),
        mask_mod=paged_mask_mod(step, logical_of, block_size, window),
        seq_lengths=(step.num_tokens, pool_blocks * block_size), compute_q_blocks=False)
    return FlexAttentionMetadata(step, window, logical_of, block_mask)


def tile_blocks(tile: torch.Tensor, block: torch.Tensor, num_tiles: int, pool_blocks: int,
                width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile, the distinct blocks of its (tile, block) pairs (block == pool_blocks:
    an invalid pair): counts [tiles] and indices [tiles, width], the listed blocks first, both
    int32. Sorting the pairs costs what the step's tables hold, not what the pool holds."""
    span = pool_blocks + 1
    key, _ = torch.sort(tile * span + block)
    tile, block = key // span, key % span
    keep = block != pool_blocks
    keep[1:] &= key[1:] != key[:-1]
    counts = torch.zeros(num_tiles, dtype=torch.long, device=key.device)
    counts.index_add_(0, tile, keep.long())
    before = torch.cumsum(counts, 0) - counts          # kept blocks of the tiles before
    rank = torch.cumsum(keep.long(), 0) - 1 - before[tile]
    col = torch.where(keep, rank, width)               # the rest land in a spare column
    indices = torch.zeros(num_tiles, width + 1, dtype=torch.int32, device=key.device)
    indices[tile, col] = block.to(torch.int32)
    return counts.to(torch.int32), indices[:, :width]


def paged_mask_mod(step: FlexStepTensors, logical_of: torch.Tensor, block_size: int,
                   window: int | None):
    """FlexAttention's mask_mod: query row q_idx may read pool slot kv_idx (the keys before
    its base, inside its window; then those on its tree path, a plain row having none)."""
    q_seq, q_pos, q_base, q_bits = step.q_seq, step.q_pos, step.q_base, step.q_bits

    def mask_mod(b, h, q_idx, kv_idx):
        logical = logical_of[q_seq[q_idx], kv_idx // block_size]
        kv_pos = logical * block_size + kv_idx % block_size
        base = q_base[q_idx]
        in_prefix = kv_pos < base
        if window is not None:
            in_prefix = in_prefix & (kv_pos > q_pos[q_idx] - window)
        shift = (kv_pos - base).clamp(0, 63)
        on_path = (kv_pos >= base) & ((q_bits[q_idx] >> shift) & 1 == 1)
        return (logical >= 0) & (in_prefix | on_path)
    return mask_mod
