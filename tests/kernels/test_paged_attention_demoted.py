"""The decode kernel over a float32 cache with demoted blocks (engine/kv_demotion.py): int8
blocks in the cache's own bytes, named by table entries below -1, read against the reference;
a row that reads only int8 blocks computes what the int8 cache computes, bit for bit; a row
without demoted blocks is the same whether the step has demoted scales or not."""
import pytest
import torch

from kvslim.attention.kv_cache import quantize
from kvslim.kernels import extension, paged_attention

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")
BLOCKS, BS, KVH, D, H = 12, 4, 2, 32, 6
BOUND = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built():
    assert paged_attention.available(), extension.load()


def cache_with_demotions(seed: int = 0):
    """Blocks 0-7 float32; blocks 8 and 9 hold int8 blocks 32-35 and 36-39 (4 in each), the
    demotions of the float32 blocks 8-11 as they were, and 10, 11 the rest. Returns the caches,
    the scales and the int8 block each original float32 block went to."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(BLOCKS, BS, KVH, D, generator=g) for _ in range(2))
    scales = torch.zeros(2, 4 * BLOCKS, BS, KVH, dtype=torch.float16)
    originals = (k.clone(), v.clone())
    moved = {}
    for n, src in enumerate((10, 11, 2, 3)):       # sources read before any write lands
        dst = 4 * 8 + n
        q = [quantize(c[src], torch.int8) for c in originals]
        for i, cache in enumerate((k, v)):
            paged_attention.demoted_view(cache)[dst] = q[i][0]
            scales[i, dst] = q[i][1]
        moved[src] = dst
    return k, v, scales, moved


def test_mixed_tables_match_the_reference():
    k, v, scales, moved = cache_with_demotions()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, H, D, generator=g)
    # rows: two demoted blocks first then float32 ones; all float32; one demoted in the middle
    tables = torch.tensor([[-2 - moved[10], -2 - moved[11], 0, 1, 4],
                           [0, 1, 4, 5, 6],
                           [5, -2 - moved[2], 6, 7, 0]], dtype=torch.int32)
    lens = torch.tensor([19, 17, 14])
    got = paged_attention.paged_decode(q, k, v, None, None, tables, lens, 0, None, D ** -0.5,
                                       demoted_scales=scales)
    ref = paged_attention.reference_paged_decode(q, k, v, None, None, tables, lens, 0, None,
                                                 D ** -0.5, demoted_scales=scales)
    assert (got.double() - ref).abs().max() / ref.abs().max() < BOUND


def test_a_demoted_row_computes_what_an_int8_cache_computes():
    """The same codes and scales as an int8 cache's blocks: the same arithmetic, so the same
    bits (the int8 cache's row dequantizes code * scale as the demoted view's does)."""
    k, v, scales, moved = cache_with_demotions()
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(2))
    ids = [moved[b] for b in (10, 11, 2, 3)]
    views = [paged_attention.demoted_view(c) for c in (k, v)]
    int8 = [views[0][ids], views[1][ids], scales[0, ids], scales[1, ids]]
    lens = torch.tensor([15])
    plain = paged_attention.paged_decode(q, *int8, torch.tensor([[0, 1, 2, 3]]), lens, 0,
                                         None, D ** -0.5)
    mixed = paged_attention.paged_decode(q, k, v, None, None,
                                         torch.tensor([[-2 - i for i in ids]]), lens, 0, None,
                                         D ** -0.5, demoted_scales=scales)
    assert torch.equal(plain, mixed)


def test_a_row_without_demoted_blocks_does_not_depend_on_them():
    k, v, scales, moved = cache_with_demotions()
    q = torch.randn(2, H, D, generator=torch.Generator().manual_seed(3))
    tables = torch.tensor([[0, 1, 4, 5], [-2 - moved[10], 6, 7, 0]], dtype=torch.int32)
    lens = torch.tensor([16, 13])
    batched = paged_attention.paged_decode(q, k, v, None, None, tables, lens, 0, None, 0.2,
                                           demoted_scales=scales)
    alone = paged_attention.paged_decode(q[:1], k, v, None, None, tables[:1], lens[:1], 0, None,
                                         0.2)
    assert torch.equal(batched[0], alone[0])


def test_a_demoted_entry_without_scales_is_refused():
    k, v, _, moved = cache_with_demotions()
    q = torch.randn(1, H, D)
    with pytest.raises(RuntimeError, match="demoted block"):
        paged_attention.paged_decode(q, k, v, None, None, torch.tensor([[-2 - moved[10]]]),
                                     torch.tensor([3]), 0, None, 0.2)
    with pytest.raises(RuntimeError, match="float16 scales \\[4 \\* blocks"):
        paged_attention.paged_decode(q, k, v, None, None, torch.tensor([[0]]), torch.tensor([3]),
                                     0, None, 0.2, demoted_scales=torch.zeros(2, 4, BS, KVH,
                                                                              dtype=torch.float16))
