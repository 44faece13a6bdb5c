"""FlexPagedAttention (K/V read in place through the block tables) against the gather path, on
random steps: shuffled physical blocks, decodes and prefill chunks in one step, prefixes cached
and shared between sequences, MHA/GQA/MQA, sliding windows with released and stale table
entries. And its block mask: every slot a query may read lies in a block its tile lists, and a
tile lists only blocks its sequences hold."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvslim.attention import (FlexPagedAttention, KVCacheLayer, PagedAttention, PagedStepLayout,
                              PrefillChunk, build_flex_layer_metadata, build_layer_metadata)
from kvslim.attention.flex_metadata import Q_TILE

D, POOL = 16, 80


@dataclass
class Step:
    kv: torch.Tensor                  # [K/V, pool blocks, block_size, kvh, D]
    layout: PagedStepLayout
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq_blocks: list[list[int]]       # every sequence's blocks, from position 0
    seq_positions: list[list[int]]    # positions of each sequence's new tokens


def first_needed(pos: int, window: int | None, bs: int) -> int:
    return 0 if window is None else max(0, pos - window + 1) // bs


def random_step(seed: int, heads: int, kvh: int, bs: int, decodes: list[int],
                prefills: list[tuple[int, int]], window: int | None = None,
                share: int = 0) -> Step:
    """decodes: context lengths after the step; prefills: (cached, new) tokens per chunk.
    share: blocks every later sequence takes from sequence 0's start (a prefix-cache hit)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(POOL, generator=g).tolist()
    contexts = decodes + [c + n for c, n in prefills]
    seq_blocks = []
    for i, ctx in enumerate(contexts):
        need = -(-ctx // bs)
        own = seq_blocks[0][:share] if i and share else []
        seq_blocks.append(own + [perm.pop() for _ in range(need - len(own))])
    nd = len(decodes)
    firsts = [first_needed(n - 1, window, bs) for n in decodes]
    width = max((len(b) for b in seq_blocks[:nd]), default=0) + 2     # padded past the end
    rows = []
    for blocks, first in zip(seq_blocks[:nd], firsts):
        stale = torch.randint(0, POOL, (width,), generator=g).tolist()   # a reused row's ids
        row = stale[:min(firsts)] + blocks[min(firsts):] + stale[len(blocks):]
        for j in range(min(firsts), first):          # released: 0, or an id held later
            row[j] = blocks[-1] if j % 2 else 0
        row[len(blocks)] = blocks[first]             # past the end: an id it holds earlier
        rows.append(row)
    seq_positions = [[n - 1] for n in decodes] + [list(range(c, c + n)) for c, n in prefills]
    slots = [seq_blocks[s][p // bs] * bs + p % bs
             for s, ps in enumerate(seq_positions) for p in ps]
    chunks, start = [], nd
    for i, (c, n) in enumerate(prefills):
        first = first_needed(c, window, bs)
        chunks.append(PrefillChunk(query_start=start, query_len=n, context_len=c + n,
                                   block_table=torch.tensor(seq_blocks[nd + i][first:]),
                                   key_start=first * bs))
        start += n
    layout = PagedStepLayout(
        slot_mapping=torch.tensor(slots), num_decode_tokens=nd,
        decode_block_tables=torch.tensor(rows) if nd else None,
        decode_context_lens=torch.tensor(decodes) if nd else None,
        decode_key_start=min(firsts, default=0) * bs,
        prefills=chunks)
    n = len(slots)
    return Step(torch.randn(2, POOL, bs, kvh, D, generator=g), layout,
                torch.randn(n, heads, D, generator=g), torch.randn(n, kvh, D, generator=g),
                torch.randn(n, kvh, D, generator=g), seq_blocks, seq_positions)


def attend_both(step: Step, window: int | None):
    outs = []
    for backend in ("gather", "flex"):
        kv = step.kv.clone()
        caches = [KVCacheLayer(kv[0], kv[1])]
        bs = kv.shape[2]
        if backend == "gather":
            attn = PagedAttention(caches, build_layer_metadata(step.layout, bs, [window]))
        else:
            attn = FlexPagedAttention(caches, build_flex_layer_metadata(
                step.layout, bs, POOL, [window]))
        outs.append(attn.attend(0, step.q, step.k, step.v, 0.3))
        if backend == "flex":
            torch.testing.assert_close(kv, written)            # the same cache writes
        written = kv
    return outs


CASES = {   # name: (heads, kvh, block_size, decodes, prefills, window, share)
    "gqa_mixed": (8, 2, 4, [9, 1, 17], [(0, 6), (8, 5)], None, 0),
    "mha_mixed": (4, 4, 4, [13, 30], [(5, 12)], None, 0),
    "mqa_mixed": (8, 1, 8, [3, 40, 22, 7], [(16, 9), (0, 20)], None, 0),
    "decodes_only": (8, 2, 4, [5, 16, 33, 2, 21], [], None, 0),
    "lone_decode": (8, 2, 4, [27], [], None, 0),
    "prefill_only_shared_prefix": (8, 2, 4, [], [(12, 7), (12, 3), (0, 5)], None, 3),
    "decodes_sharing_a_prefix": (8, 2, 4, [26, 19, 30], [(16, 4)], None, 4),
    "window_mixed": (8, 2, 4, [9, 30, 41, 14], [(19, 6), (0, 11)], 7, 0),
    "window_mqa_lone_decode": (8, 1, 4, [38], [(25, 18)], 10, 0),
    "many_tiles": (4, 2, 4, [11] * 20, [(7, 40)], None, 0),
}


@pytest.mark.parametrize("name", CASES)
def test_flex_matches_gather(name):
    heads, kvh, bs, decodes, prefills, window, share = CASES[name]
    step = random_step(len(name), heads, kvh, bs, decodes, prefills, window, share)
    gather, flex = attend_both(step, window)
    assert flex.shape == gather.shape == step.q.shape
    torch.testing.assert_close(flex, gather, atol=1e-5, rtol=1e-5)


def test_flex_reads_fresh_keys_through_the_cache():
    """Changing a context key changes the result (the pool is what is read), and a stale slot
    past a sequence's end changes nothing."""
    step = random_step(1, 8, 2, 4, [10], [(4, 3)])
    _, base = attend_both(step, None)
    block = step.seq_blocks[0][2]              # positions 8..11 of the decode: 8, 9 live
    step.kv[:, block, 3] = 1e3                  # position 11: past its end (10 tokens)
    assert torch.allclose(attend_both(step, None)[1], base)
    step.kv[:, block, 0] = 1e3                  # position 8: in its context
    assert not torch.allclose(attend_both(step, None)[1][0], base[0])


def reference_allowed(step: Step, bs: int, window: int | None) -> torch.Tensor:
    """[N, POOL * bs]: each new token may read its own sequence's slots up to its position."""
    allowed = torch.zeros(sum(map(len, step.seq_positions)), POOL * bs, dtype=torch.bool)
    row = 0
    for blocks, positions in zip(step.seq_blocks, step.seq_positions):
        for pos in positions:
            lo = 0 if window is None else max(0, pos - window + 1)
            for key in range(lo, pos + 1):
                allowed[row, blocks[key // bs] * bs + key % bs] = True
            row += 1
    return allowed


@pytest.mark.parametrize("name", ["gqa_mixed", "window_mixed", "many_tiles",
                                  "prefill_only_shared_prefix"])
def test_block_mask_lists_what_each_tile_reads(name):
    heads, kvh, bs, decodes, prefills, window, share = CASES[name]
    step = random_step(len(name), heads, kvh, bs, decodes, prefills, window, share)
    meta = build_flex_layer_metadata(step.layout, bs, POOL, [window])[0]
    n = step.q.shape[0]
    q_idx, kv_idx = torch.arange(n)[:, None], torch.arange(POOL * bs)[None, :]
    allowed = meta.block_mask.mask_mod(0, 0, q_idx, kv_idx)
    assert torch.equal(allowed, reference_allowed(step, bs, window))
    counts = meta.block_mask.kv_num_blocks[0, 0]
    indices = meta.block_mask.kv_indices[0, 0]
    assert counts.shape[0] == -(-n // Q_TILE) > 0
    seq_of_row = [s for s, ps in enumerate(step.seq_positions) for _ in ps]
    for tile, count in enumerate(counts.tolist()):
        listed = indices[tile, :count].tolist()
        rows = range(tile * Q_TILE, min(n, (tile + 1) * Q_TILE))
        needed = set((allowed[list(rows)].any(0).nonzero()[:, 0] // bs).tolist())
        held = {b for r in rows for b in step.seq_blocks[seq_of_row[r]]}
        assert len(listed) == len(set(listed))
        assert needed <= set(listed) <= held


def test_flex_reads_the_pool_in_place_with_kv_heads():
    """The kernel gets views of the cache (same storage: nothing gathered) with KV heads, not
    query heads (enable_gqa: K/V never repeated per query head)."""
    step = random_step(2, 8, 2, 4, [9, 14], [(4, 5)])
    kv = step.kv.clone()
    attn = FlexPagedAttention([KVCacheLayer(kv[0], kv[1])],
                              build_flex_layer_metadata(step.layout, 4, POOL, [None]))
    calls = []
    flex = attn.flex
    attn.flex = lambda q, k, v, **kw: calls.append((q, k, v, kw)) or flex(q, k, v, **kw)
    attn.attend(0, step.q, step.k, step.v, 0.3)
    (q, k, v, kw), = calls
    assert q.shape == (1, 8, step.q.shape[0], D)
    assert k.shape == v.shape == (1, 2, POOL * 4, D)
    assert k.data_ptr() == kv[0].data_ptr() and v.data_ptr() == kv[1].data_ptr()
    assert kw["enable_gqa"] and kw["scale"] == 0.3
