"""The int8-activation group kernel: its block quantization equals the plain-torch one exactly;
the kernel matches the float64 reference of its arithmetic within a stated bound for 4- and
8-bit weights, every M in 1..64 and odd output counts; rows bit-identical across M."""
import pytest
import torch

from group_weights import weight
from kvslim.kernels import extension, group_q8

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")
BOUND = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built():
    if extension.available() and not group_q8.available():
        pytest.skip("this CPU has no AVX-512 VNNI: the kernel has no path here")
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


def test_shapes_it_cannot_take_are_refused():
    q, scales, mins = weight(4, 16, 48, 16)
    assert not group_q8.usable(48, 3)
    with pytest.raises(ValueError, match="blocks of 32 inputs"):
        group_q8.pack_q8_weight(q, scales, mins, 4)
