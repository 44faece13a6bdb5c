"""The per-head matrix product of DeepSeek's absorbed attention (kernels/head_mm.py): torch's
batched product within float32 rounding, every row's bits independent of the other rows, strided
inputs, refusals."""
import pytest
import torch

from kvslim.kernels import extension, head_mm

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert head_mm.available(), extension.load()


@pytest.mark.parametrize("h,k,o", [(8, 32, 64), (9, 64, 48), (16, 128, 512), (3, 5, 7)])
def test_matches_the_batched_product(h, k, o):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, h, k, generator=g), torch.randn(h, k, o, generator=g)
    got = torch.ops.kvslim.head_mm(x, w)
    ref = torch.einsum("nhk,hko->nho", x.double(), w.double())
    assert got.shape == (11, h, o)
    assert (got.double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_a_row_does_not_depend_on_the_others():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(33, 9, 64, generator=g), torch.randn(9, 64, 48, generator=g)
    batched = torch.ops.kvslim.head_mm(x, w)
    for n in (1, 2, 7):
        assert torch.equal(torch.ops.kvslim.head_mm(x[:n], w), batched[:n])
    strided = torch.randn(9, 33, 64, generator=g).transpose(0, 1)      # [N, H, K], strided
    assert torch.equal(torch.ops.kvslim.head_mm(strided, w),
                       torch.ops.kvslim.head_mm(strided.contiguous(), w))


def test_refusals():
    x, w = torch.randn(2, 3, 4), torch.randn(3, 4, 5)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvslim.head_mm(x.double(), w)
    with pytest.raises(RuntimeError, match="heads and width"):
        torch.ops.kvslim.head_mm(x, w[:2])
    assert head_mm.head_mm(x.double(), w.double()).shape == (2, 3, 5)   # torch.bmm's path
