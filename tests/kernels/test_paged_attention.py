"""The decode kernel reading the paged cache in place: the plain-torch reference within a stated
bound for float32 and int8 caches, GQA, MQA and MHA, windows and a table that starts past the
first block, a latent cache whose value is a view of its key; a sequence's bits independent of the
batch and of the tables' padding."""
import pytest
import torch

from kvslim.kernels import extension, paged_attention

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")
BOUND = 1e-5                       # float32 against float64, relative to the largest output
BLOCKS, BS = 40, 4


@pytest.fixture(scope="module", autouse=True)
def built():
    assert paged_attention.available(), extension.load()


def caches(kvh: int, d: int, int8: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BS, kvh, d)
    if not int8:
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g), None, None
    k = torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)
    v = torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)
    ks = (torch.rand(BLOCKS, BS, kvh, generator=g) * 0.02).half()
    vs = (torch.rand(BLOCKS, BS, kvh, generator=g) * 0.02).half()
    return k, v, ks, vs


def step(b: int, h: int, d: int, width: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=g)
    tables = torch.stack([torch.randperm(BLOCKS, generator=g)[:width] for _ in range(b)])
    lens = torch.randint(1, width * BS + 1, (b,), generator=g)
    return q, tables.to(torch.int32), lens


@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 1, 256), (4, 4, 24)])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window,key_start,width", [(None, 0, 7), (5, 0, 7), (None, 8, 7),
                                                    (None, 0, 40), (70, 0, 40), (None, 8, 38)])
def test_the_kernel_matches_its_reference(h, kvh, d, int8, window, key_start, width):
    """Width 40 holds up to 160 keys: up to three partitions of 64, a window across two."""
    kv = caches(kvh, d, int8)
    q, tables, lens = step(6, h, d, width=width)
    lens = lens + key_start
    got = paged_attention.paged_decode(q, *kv, tables, lens, key_start, window, d ** -0.5)
    ref = paged_attention.reference_paged_decode(q, *kv, tables, lens, key_start, window,
                                                 d ** -0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() / ref.abs().max() < BOUND


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window,key_start", [(None, 0), (5, 0), (None, 8)])
def test_a_latent_cache_whose_value_is_a_view_of_its_key(int8, window, key_start):
    """DeepSeek's latent rows (attention/latent_cache.py): one KV head, the key the row
    [c_kv; k_rope] (48 + 16), the value a view of its first 48 entries with the key's scales;
    the output has the value's width."""
    k, _, ks, _ = caches(1, 64, int8)
    v = k[..., :48]
    q, tables, lens = step(5, 8, 64, width=38)
    lens = lens + key_start
    got = paged_attention.paged_decode(q, k, v, ks, ks, tables, lens, key_start, window, 0.125)
    ref = paged_attention.reference_paged_decode(q, k, v, ks, ks, tables, lens, key_start,
                                                 window, 0.125)
    assert got.shape == (5, 8, 48) and ref.shape == got.shape
    assert (got.double() - ref).abs().max() / ref.abs().max() < BOUND
    copied = paged_attention.paged_decode(q, k, v.contiguous(), ks, ks, tables, lens,
                                          key_start, window, 0.125)
    assert torch.equal(got, copied)


@pytest.mark.parametrize("width", [6, 30])
def test_a_sequence_does_not_depend_on_the_batch_or_the_padding(width):
    kv = caches(3, 64, int8=False)
    q, tables, lens = step(8, 9, 64, width=width)
    batched = paged_attention.paged_decode(q, *kv, tables, lens, 0, None, 0.125)
    for i in range(len(q)):
        wider = torch.cat([tables[i:i + 1], torch.zeros(1, 5, dtype=torch.int32)], dim=1)
        alone = paged_attention.paged_decode(q[i:i + 1], *kv, wider, lens[i:i + 1], 0, None,
                                             0.125)
        assert torch.equal(alone[0], batched[i])


def test_a_sequence_with_nothing_to_see_gets_zeros():
    kv = caches(1, 16, int8=False)
    q, tables, _ = step(2, 2, 16, width=2)
    out = paged_attention.paged_decode(q, *kv, tables, torch.tensor([0, 3]), 0, None, 0.25)
    assert torch.equal(out[0], torch.zeros(2, 16)) and out[1].abs().sum() > 0


def test_bad_inputs_are_refused():
    k, v, _, _ = caches(2, 16, int8=False)
    q, tables, lens = step(2, 4, 16, width=2)
    with pytest.raises(RuntimeError, match="q must be float32"):
        paged_attention.paged_decode(q.double(), k, v, None, None, tables, lens, 0, None, 1.0)
    with pytest.raises(RuntimeError, match="one block table and one length per query"):
        paged_attention.paged_decode(q, k, v, None, None, tables[:1], lens, 0, None, 1.0)
    with pytest.raises(RuntimeError, match="at most the keys' width"):
        paged_attention.paged_decode(q, k[..., :8], v, None, None, tables, lens, 0, None, 1.0)
    with pytest.raises(RuntimeError, match="float32, or int8 with float16 scales"):
        paged_attention.paged_decode(q, k.to(torch.int8), v.to(torch.int8), None, None,
                                     tables, lens, 0, None, 1.0)
    assert paged_attention.supports(torch.int8, torch.float32, torch.device("cpu"))
    assert not paged_attention.supports(torch.bfloat16, torch.bfloat16, torch.device("cpu"))


def tree_rows(prefix: int, parents: list[int]):
    """Rows of a tree of drafts laid after `prefix` cached keys: parents[i] is node i's parent
    (-1: the root, row 0). Returns (lens, base, bits) per row."""
    bits, depth = [], []
    for i, parent in enumerate(parents):
        bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
        depth.append(depth[parent] + 1 if parent >= 0 else 0)
    n = len(parents)
    return (torch.tensor([prefix + d + 1 for d in depth]), torch.full((n,), prefix),
            torch.tensor(bits))


TREE = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]       # a root, three children, then a path of four


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("prefix,window", [(0, None), (5, None), (61, None), (70, 6)])
def test_tree_rows_match_the_reference(int8, prefix, window):
    """Each row over the keys before `prefix` and its own path; the reference picks the same
    positions out by hand. Prefix 61 puts a path across the first partition's end."""
    kv = caches(3, 64, int8)
    lens, base, bits = tree_rows(prefix, TREE)
    q, tables, _ = step(len(TREE), 9, 64, width=25)
    got = paged_attention.paged_decode(q, *kv, tables, lens, 0, window, 0.125, base, bits)
    ref = paged_attention.reference_paged_decode(q, *kv, tables, lens, 0, window, 0.125, base,
                                                 bits)
    assert (got.double() - ref).abs().max() / ref.abs().max() < BOUND


@pytest.mark.parametrize("prefix", [3, 62])
def test_a_tree_row_is_bit_for_bit_the_plain_decode_of_its_path(prefix):
    """The same query over a cache holding its path contiguously (what plain decoding would
    have written) gives the same bits: the tree changes where keys are read, not the sums."""
    k, v, _, _ = caches(3, 64, int8=False)
    lens, base, bits = tree_rows(prefix, TREE)
    q, tables, _ = step(len(TREE), 9, 64, width=20)
    tree = paged_attention.paged_decode(q, k, v, None, None, tables, lens, 0, None, 0.125, base,
                                        bits)
    for row in range(len(TREE)):
        path = [prefix + i for i in range(len(TREE)) if int(bits[row]) >> i & 1]
        k2, v2 = k.clone(), v.clone()
        for d, src in enumerate(path):                      # the path moved into place
            dst = prefix + d
            for c, c2 in ((k, k2), (v, v2)):
                c2[tables[row, dst // BS], dst % BS] = c[tables[row, src // BS], src % BS]
        plain = paged_attention.paged_decode(q[row:row + 1], k2, v2, None, None,
                                             tables[row:row + 1], lens[row:row + 1], 0, None,
                                             0.125)
        assert torch.equal(plain[0], tree[row])


def test_tree_arguments_come_together():
    k, v, _, _ = caches(2, 16, int8=False)
    q, tables, lens = step(2, 4, 16, width=2)
    with pytest.raises(RuntimeError, match="come together"):
        paged_attention.paged_decode(q, k, v, None, None, tables, lens, 0, None, 1.0,
                                     torch.zeros(2, dtype=torch.long), None)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window,sinks", [(5, 1), (5, 4), (5, 9), (70, 3), (70, 100), (20, 64)])
def test_sinks_beside_a_window_match_the_reference(int8, window, sinks):
    """Attention sinks (kv_cache/window.py): the first positions are seen past the window, in
    partitions of their own; sinks that overlap the window are seen once."""
    kv = caches(3, 64, int8)
    q, tables, lens = step(6, 9, 64, width=40)
    got = paged_attention.paged_decode(q, *kv, tables, lens, 0, window, 0.125, sinks=sinks)
    ref = paged_attention.reference_paged_decode(q, *kv, tables, lens, 0, window, 0.125,
                                                 sinks=sinks)
    assert (got.double() - ref).abs().max() / ref.abs().max() < BOUND
    plain = paged_attention.paged_decode(q, *kv, tables, lens, 0, window, 0.125)
    assert not torch.equal(got, plain) or sinks >= int(lens.max()) - window


def test_a_row_with_sinks_is_the_same_alone_and_in_a_batch():
    kv = caches(3, 64, False)
    q, tables, lens = step(6, 9, 64, width=40)
    batched = paged_attention.paged_decode(q, *kv, tables, lens, 0, 7, 0.125, sinks=4)
    for i in range(6):
        alone = paged_attention.paged_decode(q[i:i + 1], *kv, tables[i:i + 1], lens[i:i + 1],
                                             0, 7, 0.125, sinks=4)
        assert torch.equal(alone, batched[i:i + 1])


def lowbit_step(bits: int, kvh: int = 3, d: int = 64, b: int = 6, width: int = 12, seed: int = 2,
                residual: int = 1):
    """A random 4- or 2-bit pool quantized by lowbit_codes, and each row's recent rows (its
    residual: its own block and the residual - 1 before it)."""
    from kvslim.kernels.lowbit_codes import quantize_key_blocks, quantize_value_blocks
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(BLOCKS, BS, kvh, d, generator=g) + torch.randn(d, generator=g) * 3
    v = torch.randn(BLOCKS, BS, kvh, d, generator=g)
    kc, kp = quantize_key_blocks(k, bits)
    vc, vp = quantize_value_blocks(v, bits)
    q, tables, lens = step(b, 3 * kvh, d, width, seed)
    own = lens - ((lens - 1) // BS - residual + 1).clamp(min=0) * BS   # its residual's positions
    starts = torch.cumsum(own, 0) - own
    recent = [torch.randn(int(own.sum()), kvh, d, generator=g).half() for _ in range(2)]
    return q, kc, vc, kp, vp, *recent, starts, tables, lens


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("residual", [1, 2])
@pytest.mark.parametrize("window,sinks", [(None, 0), (9, 0), (9, 3), (30, 5)])
def test_the_lowbit_kernel_matches_its_reference(bits, residual, window, sinks):
    args = lowbit_step(bits, residual=residual)
    got = paged_attention.paged_decode_lowbit(*args, 0, window, 0.125, sinks, bits, residual)
    ref = paged_attention.reference_paged_decode_lowbit(*args, 0, window, 0.125, sinks, bits,
                                                        residual)
    assert (got.double() - ref).abs().max() / ref.abs().max() < BOUND


def test_a_lowbit_row_is_the_same_alone_and_in_a_batch():
    q, kc, vc, kp, vp, rk, rv, starts, tables, lens = lowbit_step(4)
    batched = paged_attention.paged_decode_lowbit(q, kc, vc, kp, vp, rk, rv, starts, tables,
                                                  lens, 0, None, 0.125, 0, 4)
    for i in range(q.shape[0]):
        own = int((lens[i] - 1) % BS + 1)
        s = int(starts[i])
        alone = paged_attention.paged_decode_lowbit(
            q[i:i + 1], kc, vc, kp, vp, rk[s:s + own].contiguous(), rv[s:s + own].contiguous(),
            torch.zeros(1, dtype=torch.long), tables[i:i + 1], lens[i:i + 1], 0, None, 0.125, 0, 4)
        assert torch.equal(alone, batched[i:i + 1])


@pytest.mark.parametrize("bits", [4, 2])
def test_codes_round_trip(bits):
    from kvslim.kernels.lowbit_codes import (dequantize_keys, dequantize_values, pack,
                                               quantize_key_blocks, quantize_value_blocks,
                                               unpack)
    codes = torch.randint(0, 2 ** bits, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, bits), bits), codes)
    x = torch.randn(3, BS, 2, 64)
    step_k = (x.amax(1) - x.amin(1)) / (2 ** bits - 1)
    assert ((dequantize_keys(*quantize_key_blocks(x, bits), bits) - x).abs()
            <= step_k[:, None] * 0.5 + 1e-2).all()
    err = (dequantize_values(*quantize_value_blocks(x, bits), bits) - x).abs()
    assert err.max() < (x.max() - x.min()) / (2 ** bits - 1)
