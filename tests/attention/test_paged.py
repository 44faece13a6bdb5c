"""PagedAttention: a decode's numbers do not depend on the batch around it — a lone decode gives
to the last bit what the same sequence gives decoded beside longer ones (whose tables widen the
padded width), with kvslim's decode kernel on any number of threads, through torch's SDPA (the
gather path) on one thread only (on two, SDPA runs other arithmetic for one sequence than for
several: attention/backends.py) — and it never sees the stale slots after its context; with the
kernel, a prompt's tokens get the same bits however the prompt is split into chunks."""
import pytest
import torch

from kvslim.attention import KVCacheLayer, PagedAttention, PagedStepLayout, build_paged_metadata
from kvslim.attention.metadata import PrefillChunk
from kvslim.kernels import extension

BLOCK, KVH, H, D = 16, 2, 6, 64


def _step(kv, tables, lens, q, k, v, kernel=False):
    slots = torch.stack([tables[i, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
                         for i, n in enumerate(lens.tolist())])
    layout = PagedStepLayout(slot_mapping=slots, num_decode_tokens=len(lens),
                             decode_block_tables=tables, decode_context_lens=lens)
    meta = build_paged_metadata(layout, BLOCK)
    return PagedAttention([KVCacheLayer(kv[0], kv[1])], meta, kernel).attend(0, q, k, v,
                                                                             D ** -0.5)


KERNEL_BUILT = not extension.disabled() and extension.missing_compiler() is None


@pytest.mark.parametrize("kernel,threads", [
    (False, 1),
    *[pytest.param(True, t, marks=pytest.mark.skipif(not KERNEL_BUILT, reason="no extension"))
      for t in (1, 2, 3)]])
def test_a_decode_is_the_same_alone_and_beside_longer_ones(kernel, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _alone_and_beside_longer_ones(kernel)
    finally:
        torch.set_num_threads(before)


def _alone_and_beside_longer_ones(kernel):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 40, BLOCK, KVH, D, generator=g)        # [K/V, blocks, block, kvh, d]
    q = torch.randn(3, H, D, generator=g)
    k, v = torch.randn(3, KVH, D, generator=g), torch.randn(3, KVH, D, generator=g)
    tables = torch.tensor([[3, 7, 1, 0, 0, 0, 0, 0], [0, 2, 5, 9, 11, 13, 17, 19],
                           [4, 6, 8, 10, 12, 0, 0, 0]])
    for n in (1, 7, 16, 37, 48):          # sequence 0's lengths: one key, mid-block, full block
        lens = torch.tensor([n, 120, 70])
        batched = _step(kv.clone(), tables, lens, q, k, v, kernel)
        alone = _step(kv.clone(), tables[:1, :-(-n // BLOCK)], lens[:1], q[:1], k[:1], v[:1],
                      kernel)
        assert alone.shape == (1, H, D)
        assert torch.equal(alone, batched[:1]), n
    # it must not see the stale slots after its context: changing them changes nothing
    stale = kv.clone()
    stale[:, 3, 7:] = 1e3                      # sequence 0's 7 keys: slots 0-6 of block 3
    lens = torch.tensor([7])
    assert torch.equal(_step(stale, tables[:1, :1], lens, q[:1], k[:1], v[:1], kernel),
                       _step(kv.clone(), tables[:1, :1], lens, q[:1], k[:1], v[:1], kernel))


def _prefill(kv, table, start, q, k, v, decodes=0):
    """Tokens start..start+len(q) of one sequence as a prefill chunk (after `start` cached
    keys), behind `decodes` one-token decodes of other sequences (blocks 30.., 20 keys each)."""
    t = q.shape[0] - decodes
    pos = torch.arange(start, start + t)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    dec_tables = torch.arange(30, 30 + 2 * decodes).view(decodes, 2)
    dec_slots = dec_tables[:, 1] * BLOCK + 3                 # position 19 of each
    chunk = PrefillChunk(query_start=decodes, query_len=t, context_len=start + t,
                         block_table=table[:-(-(start + t) // BLOCK)])
    layout = PagedStepLayout(slot_mapping=torch.cat([dec_slots, slots]),
                             num_decode_tokens=decodes, decode_block_tables=dec_tables,
                             decode_context_lens=torch.full((decodes,), 20), prefills=[chunk])
    meta = build_paged_metadata(layout, BLOCK)
    return PagedAttention([KVCacheLayer(kv[0], kv[1])], meta, kernel=True).attend(
        0, q, k, v, D ** -0.5)


@pytest.mark.skipif(not KERNEL_BUILT, reason="no extension")
def test_with_the_kernel_a_prompts_numbers_do_not_depend_on_its_chunks():
    """A 70-token prompt prefilled whole, in chunks of 23 / 47 (the second after a cached
    prefix), beside decodes of other sequences, and token by token as decodes: each token's
    attention output is the same bits every way."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 40, BLOCK, KVH, D, generator=g)
    table = torch.tensor([5, 9, 2, 14, 7])
    q, k, v = (torch.randn(70, n, D, generator=g) for n in (H, KVH, KVH))
    whole = _prefill(kv.clone(), table, 0, q, k, v)
    cache = kv.clone()
    first = _prefill(cache, table, 0, q[:23], k[:23], v[:23])
    extra = [torch.randn(2, n, D, generator=g) for n in (H, KVH, KVH)]   # two decodes before
    second = _prefill(cache, table, 23, *[torch.cat([e, t[23:]]) for e, t in zip(extra, (q, k, v))],
                      decodes=2)[2:]
    assert torch.equal(torch.cat([first, second]), whole)
    cache = kv.clone()
    one_by_one = [_step(cache, table[None], torch.tensor([i + 1]), q[i:i + 1], k[i:i + 1],
                        v[i:i + 1], kernel=True) for i in range(70)]
    assert torch.equal(torch.cat(one_by_one), whole)
