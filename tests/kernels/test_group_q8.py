"""The int8-activation group kernel: its block quantization equals the plain-torch one exactly;
the kernel matches the float64 reference of its arithmetic within a stated bound for 4- and
8-bit weights, every M in 1..64 and odd output counts; rows bit-identical across M; float16
scales (packed where exact) give float32 scales' bits."""
import pytest
import torch

from group_weights import weight
from kvslim.kernels import extension, group_q8
from kvslim.quantization.kernels import quantize_per_token, w8a8_linear

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")
BOUND = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built():
    assert group_q8.available(), extension.load()


def test_the_block_quantization_is_the_reference_one():
    x = torch.randn(7, 96) * torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(32)
    x[2, :32] = 0                                          # a block of zeros: scale 0
    xq, dx = torch.ops.kvslim.quantize_blocks(x)
    rq, rdx = group_q8.reference_quantize_blocks(x)
    assert torch.equal(xq, rq) and torch.equal(dx, rdx)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out,k,group", [(960, 576, 32), (33, 96, 16), (47, 256, 128),
                                         (16, 64, 64)])
def test_the_kernel_matches_its_reference(bits, out, k, group):
    q, scales, mins = weight(bits, out, k, group)
    packed = group_q8.pack_q8_weight(q, scales, mins, bits)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    for m in (1, 2, 3, 4, 5, 9, 31, 64):
        got = group_q8.q8_linear(x[:m], packed)
        ref = group_q8.reference_group_linear_q8(x[:m], q, scales, mins)
        assert got.shape == (m, out)
        assert (got.double() - ref).abs().max() / ref.abs().max() < BOUND, m


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_bits_do_not_depend_on_the_batch(bits):
    q, scales, mins = weight(bits, 70, 128, 32, seed=2)
    packed = group_q8.pack_q8_weight(q, scales, mins, bits)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([group_q8.q8_linear(x[i:i + 1], packed) for i in range(len(x))])
    for m in (2, 3, 4, 5, 8, 40):
        assert torch.equal(group_q8.q8_linear(x[:m], packed), alone[:m]), m


@pytest.mark.parametrize("bits", [4, 8])
def test_float16_scales_give_the_float32_scales_bits(bits, monkeypatch):
    """Scales and offsets that are float16 exactly (GGUF's) are packed at that width; the
    kernel's outputs are the bits of the same weight packed with float32 scales."""
    q, scales, mins = weight(bits, 70, 128, 32, seed=4)
    scales, mins = scales.half().float(), None if mins is None else mins.half().float()
    half = group_q8.pack_q8_weight(q, scales, mins, bits)
    assert half.scales.dtype == torch.float16
    monkeypatch.setattr(group_q8, "_scale_dtype", lambda *_: torch.float32)
    full = group_q8.pack_q8_weight(q, scales, mins, bits)
    assert full.scales.dtype == torch.float32
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(5))
    for m in (1, 2, 9):
        assert torch.equal(group_q8.q8_linear(x[:m], half), group_q8.q8_linear(x[:m], full)), m
    monkeypatch.undo()
    inexact = group_q8.pack_q8_weight(q, scales + 1e-7, mins, bits)   # not float16 any more
    assert inexact.scales.dtype == torch.float32


@pytest.mark.parametrize("out,k,group", [(960, 576, 32), (47, 256, 128), (33, 96, 32)])
def test_offsets_of_minus_eight_scales_stream_no_offsets(out, k, group):
    """llama.cpp's Q4_0 (w = (q - 8) * s): packed without offsets, 2 bytes fewer per 32
    weights with float16 scales; the reference within its bound, rows bit-identical across M."""
    q, scales, _ = weight(4, out, k, group, seed=6)
    scales = scales.half().float()
    mins = scales * -8
    packed = group_q8.pack_q8_weight(q, scales, mins, 4)
    offsets = group_q8.pack_q8_weight(q, scales, scales * -4, 4)   # any other offset: kept
    assert packed.mins is None and offsets.mins.dtype == packed.scales.dtype == torch.float16
    if group == 32:                                                 # bytes per 32 weights
        assert (packed.qweight.nbytes + packed.scales.nbytes) * 20 == (
            offsets.qweight.nbytes + offsets.scales.nbytes + offsets.mins.nbytes) * 18
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(7))
    alone = torch.cat([group_q8.q8_linear(x[i:i + 1], packed) for i in range(9)])
    for m in (1, 2, 3, 5, 9, 64):
        got = group_q8.q8_linear(x[:m], packed)
        ref = group_q8.reference_group_linear_q8(x[:m], q, scales, mins)
        assert (got.double() - ref).abs().max() / ref.abs().max() < BOUND, m
        assert torch.equal(got[:9], alone[:m]), m


def test_groups_of_sixteen_keep_their_offsets():
    """The correction is per 32-input block: groups of 16 keep the offsets' float step."""
    q, scales, _ = weight(4, 33, 96, 16, seed=8)
    assert group_q8.pack_q8_weight(q, scales, scales * -8, 4).mins is not None


def test_shapes_it_cannot_take_are_refused():
    q, scales, mins = weight(4, 16, 48, 16)
    assert not group_q8.usable(48, 3)
    with pytest.raises(ValueError, match="blocks of 32 inputs"):
        group_q8.pack_q8_weight(q, scales, mins, 4)


def _w8a8(out, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out, k), generator=g, dtype=torch.int8)
    return q, torch.rand(out, generator=g) * 0.02


def test_the_row_quantization_is_quantize_per_token():
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1.0, 50.0, 1.0, 1.0, 1.0])[:, None]
    x[3] = 0                                               # a row of zeros: the smallest scale
    x[4, 5] = -x[4].abs().max() * 2                        # the largest magnitude negative
    xq, sx = torch.ops.kvslim.quantize_rows(x, None)
    rq, rsx = quantize_per_token(x)
    assert torch.equal(xq, rq) and torch.equal(sx, rsx)
    amax = x.abs().amax(-1, keepdim=True) * 3              # a shard of a wider row
    xq, sx = torch.ops.kvslim.quantize_rows(x, amax)
    rq, rsx = quantize_per_token(x, amax)
    assert torch.equal(xq, rq) and torch.equal(sx, rsx)


@pytest.mark.parametrize("out,k", [(960, 576), (37, 96), (576, 1536), (17, 32)])
def test_w8a8_is_torchs_integer_product_bit_for_bit(out, k):
    """The same codes, an exact integer sum and the same two float multiplies as w8a8_linear
    on torch._int_mm: every output the same bits, for every M and an odd number of outputs."""
    q, scales = _w8a8(out, k)
    packed = group_q8.pack_w8a8_weight(q, scales)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1)) * 3
    for m in (1, 2, 3, 4, 5, 9, 31, 64):
        got = group_q8.w8a8_mm(x[:m], packed)
        assert got.shape == (m, out)
        assert torch.equal(got, w8a8_linear(x[:m], q, scales)), m
    amax = x.abs().amax(-1, keepdim=True) * 2
    assert torch.equal(group_q8.w8a8_mm(x, packed, amax), w8a8_linear(x, q, scales, None, amax))


def test_a_w8a8_rows_bits_do_not_depend_on_the_batch():
    q, scales = _w8a8(70, 128, seed=2)
    packed = group_q8.pack_w8a8_weight(q, scales)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([group_q8.w8a8_mm(x[i:i + 1], packed) for i in range(len(x))])
    for m in (2, 3, 4, 5, 8, 40):
        assert torch.equal(group_q8.w8a8_mm(x[:m], packed), alone[:m]), m
