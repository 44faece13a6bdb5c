"""PagedAttention: a lone decode (the unmasked fast path) attends exactly like the same sequence
decoded beside others (the masked, padded path)."""
import torch

from kvslim.attention import KVCacheLayer, PagedAttention, PagedStepLayout, build_paged_metadata

BLOCK, KVH, H, D = 4, 2, 6, 8


def _step(kv, tables, lens, q, k, v):
    slots = torch.stack([tables[i, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
                         for i, n in enumerate(lens.tolist())])
    layout = PagedStepLayout(slot_mapping=slots, num_decode_tokens=len(lens),
                             decode_block_tables=tables, decode_context_lens=lens,
                             decode_context_lens_host=lens.tolist())
    meta = build_paged_metadata(layout, BLOCK)
    # the lone decode takes the unmasked path, its length read from the host's copy
    assert meta.single_decode_len == (lens.tolist()[0] if len(lens) == 1 else None)
    return PagedAttention([KVCacheLayer(kv[0], kv[1])], meta).attend(0, q, k, v, D ** -0.5)


def test_single_decode_equals_batched_decode():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 12, BLOCK, KVH, D, generator=g)        # [K/V, blocks, block, kvh, d]
    q = torch.randn(2, H, D, generator=g)
    k, v = torch.randn(2, KVH, D, generator=g), torch.randn(2, KVH, D, generator=g)
    tables = torch.tensor([[3, 7, 1], [0, 2, 5]])
    lens = torch.tensor([10, 7])               # sequence 0 ends mid-block: padding to mask
    batched = _step(kv.clone(), tables, lens, q, k, v)
    single = _step(kv.clone(), tables[:1], lens[:1], q[:1], k[:1], v[:1])
    assert single.shape == (1, H, D)
    torch.testing.assert_close(single, batched[:1], atol=1e-6, rtol=1e-5)
    # and it must not see the stale slots after its context: changing them changes nothing
    stale = kv.clone()
    stale[:, 1, 2:] = 1e3                      # positions 8, 9 live in block 1; 10, 11 are stale
    assert torch.allclose(_step(stale, tables[:1], lens[:1], q[:1], k[:1], v[:1]), single)
