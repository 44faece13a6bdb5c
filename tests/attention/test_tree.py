"""A prefill chunk whose rows are a tree of drafts, through every backend (gather, flex, kvslim's
kernel) against a dense float64 reference that picks each row's keys by hand: the keys before
the chunk inside the window of the row's own position (start + depth), then its ancestors. The
other rows of the step read what they read without the tree."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from attention.test_flex import POOL, random_step
from kvslim.attention import (FlexPagedAttention, KVCacheLayer, PagedAttention,
                              build_flex_layer_metadata, build_layer_metadata)
from kvslim.attention.tree import TreeRows
from kvslim.kernels import extension, paged_attention

PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4, 4, 7)      # row 0 the root; a path of four below row 1
BACKENDS = ["gather", "flex", "kernel"]


def attend(step, backend: str, window):
    kv = step.kv.clone()
    caches, bs = [KVCacheLayer(kv[0], kv[1])], kv.shape[2]
    if backend == "flex":
        attn = FlexPagedAttention(caches, build_flex_layer_metadata(step.layout, bs, POOL,
                                                                    [window]))
    else:
        attn = PagedAttention(caches, build_layer_metadata(step.layout, bs, [window]),
                              kernel=backend == "kernel")
    return attn.attend(0, step.q, step.k, step.v, 0.3), kv


def path(tree: TreeRows, row: int) -> list[int]:
    """The rows from the root to `row`, in order."""
    return path(tree, tree.parents[row]) + [row] if row >= 0 else []


def reference_row(kv, q_row, slots: list[int], kvh: int) -> torch.Tensor:
    flat = kv.double().flatten(1, 2)                       # [K/V, pool slots, kvh, D]
    keys, values = flat[0, slots], flat[1, slots]          # [n, kvh, D]
    heads, d = q_row.shape
    q = q_row.double().view(kvh, heads // kvh, d)
    scores = torch.einsum("kgd,nkd->kgn", q, keys) * 0.3
    return torch.einsum("kgn,nkd->kgd", scores.softmax(-1), values).reshape(heads, d)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cached, window", [(0, None), (13, None), (21, 8)])
def test_tree_rows_read_their_prefix_and_ancestors(backend, cached, window):
    if backend == "kernel" and not paged_attention.available():
        pytest.skip(f"kvslim's kernel is not built here: {extension.load()}")
    heads, kvh, bs = 8, 2, 4
    step = random_step(cached + 1, heads, kvh, bs, [9, 17], [(5, 3), (cached, len(PARENTS))],
                       window)
    plain, _ = attend(step, backend, window)
    tree = TreeRows(PARENTS)
    chunks = step.layout.prefills
    chunks[1] = dataclasses.replace(chunks[1], tree=tree)
    out, kv = attend(step, backend, window)
    first = chunks[1].query_start
    assert torch.equal(out[:first], plain[:first])          # the other rows: as without it
    blocks = step.seq_blocks[-1]
    slot = lambda pos: blocks[pos // bs] * bs + pos % bs      # noqa: E731
    for row in range(len(PARENTS)):
        position = cached + tree.depths[row]
        lo = 0 if window is None else max(0, position - window + 1)
        slots = [slot(p) for p in range(lo, cached)] + [slot(cached + a) for a in path(tree, row)]
        ref = reference_row(kv, step.q[first + row], slots, kvh)
        torch.testing.assert_close(out[first + row].double(), ref, atol=1e-5, rtol=1e-5)


def test_a_tree_is_refused_when_malformed():
    with pytest.raises(ValueError, match="each parent an earlier row"):
        TreeRows((-1, 2, 0))
    with pytest.raises(ValueError, match="at most 64 rows"):
        TreeRows((-1,) + (0,) * 64)
    assert TreeRows((-1,) + (0,) * 63).bits[63] < 0         # the 64th row's bit: the sign bit
