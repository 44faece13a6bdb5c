"""kvslim's 2:4 sparse kernel: its plain-torch reference bit for bit and the dense product within
float tolerance, for several row counts and odd shapes; each row's bits independent of the
number of rows, of the row's place and of the threads; the packing's round trip and refusals."""
import pytest
import torch

from kvslim.kernels import extension, sparse24
from thread_counts import outputs_at_thread_counts

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert sparse24.available(), extension.load()


def sparse_weight(out: int, k: int, seed: int = 0, kept: int = 2) -> torch.Tensor:
    """A random [out, k] weight with `kept` (or fewer) nonzeros in every group of four."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g)
    order = torch.rand(out, k // 4, 4, generator=g).argsort(-1)[..., :kept]
    mask = torch.zeros(out, k // 4, 4).scatter(-1, order, 1.0).view(out, k)
    return w * mask


@pytest.mark.parametrize("out,k", [(576, 576), (192, 576), (33, 96), (1, 64), (47, 1540),
                                   (100, 4)])
def test_the_kernel_is_its_reference_and_the_dense_product(out, k):
    w = sparse_weight(out, k)
    packed = sparse24.pack_sparse24_weight(w)
    assert torch.equal(sparse24.dense(packed), w)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(1))
    for m in (1, 3, 16, 33):
        got = sparse24.sparse24_linear(x[:m], packed)
        assert got.shape == (m, out) and got.dtype == torch.float32
        assert torch.equal(got, sparse24.reference_sparse24_linear(x[:m], packed)), m
        dense = x[:m].double() @ w.double().T
        err = (got.double() - dense).abs().max() / dense.abs().max()
        assert err < 1e-5, (m, float(err))


def test_groups_with_fewer_than_two_nonzeros_and_a_bias():
    w = sparse_weight(40, 64, kept=1)
    w[3] = 0
    packed = sparse24.pack_sparse24_weight(w)
    assert torch.equal(sparse24.dense(packed), w)
    x, bias = torch.randn(3, 64), torch.randn(40)
    got = sparse24.sparse24_linear(x, packed, bias)
    assert torch.allclose(got, torch.nn.functional.linear(x, w, bias), atol=1e-5, rtol=1e-5)
    assert torch.equal(got, sparse24.reference_sparse24_linear(x, packed) + bias)


def test_a_rows_bits_do_not_depend_on_the_batch():
    packed = sparse24.pack_sparse24_weight(sparse_weight(100, 128, seed=2))
    x = torch.randn(150, 128, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([sparse24.sparse24_linear(x[i:i + 1], packed) for i in range(len(x))])
    for m in (2, 3, 4, 5, 7, 8, 13, 16, 33, 64, 65, 150):   # every micro-kernel, a second chunk
        assert torch.equal(sparse24.sparse24_linear(x[:m], packed), alone[:m]), m
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(4))
    assert torch.equal(sparse24.sparse24_linear(x[order], packed), alone[order])


def test_the_threads_do_not_change_the_bits():
    packed = sparse24.pack_sparse24_weight(sparse_weight(512, 256))
    x = torch.randn(9, 256)
    outs = outputs_at_thread_counts(lambda: sparse24.sparse24_linear(x, packed))
    assert torch.equal(outs[0], outs[1])


def halfway_cases(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 a in [1, 2) and b ~ 2^-24 / a with a * b = 2^-24 + d, 0 < |d| < 2^-54: then
    1 + a * b lies within 2^-54 of float32's halfway point 1 + 2^-24, which float64 rounds
    onto, so rounding to float64 and then to float32 misses what one rounding gives."""
    a, b = [], []
    for big_a in range(2**23 + 12345, 2**24, 997):
        big_b = round(2**47 / big_a)
        if 0 < abs(big_a * big_b - 2**47) < 2**17:
            a.append(big_a * 2.0 ** -23)
            b.append(big_b * 2.0 ** -48)
            if len(a) == n:
                break
    return torch.tensor(a), torch.tensor(b)


def test_fma32_rounds_once_where_float64_would_round_twice():
    """The kernel's hardware FMA is the oracle: weight rows (1, a, 0, 0) and input rows
    (1, b, 0, 0) give y[m, n] = fma(a[n], b[m], 1)."""
    a, b = halfway_cases(32)
    w, x = torch.zeros(32, 4), torch.zeros(32, 4)
    w[:, 0], w[:, 1], x[:, 0], x[:, 1] = 1.0, a, 1.0, b
    hardware = sparse24.sparse24_linear(x, sparse24.pack_sparse24_weight(w))
    one = torch.ones(32, 32)
    assert torch.equal(hardware, sparse24.fma32(a[None, :], b[:, None], one))
    twice = (a.double() * b.double() + 1).float()
    assert not torch.equal(hardware.diagonal(), twice)       # the cases do round twice
    assert torch.equal(hardware.diagonal() > 1, a.double() * b.double() > 2.0 ** -24)


def test_other_dtypes_and_shapes_are_computed_in_float32():
    packed = sparse24.pack_sparse24_weight(sparse_weight(40, 64))
    x = torch.randn(2, 3, 64)
    y = sparse24.sparse24_linear(x.bfloat16(), packed)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y, sparse24.sparse24_linear(x.bfloat16().float(), packed).bfloat16())
    assert sparse24.sparse24_linear(torch.empty(0, 64), packed).shape == (0, 40)


def test_bad_weights_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^not a 2:4 weight: row 1 has 3 nonzeros in inputs "
                                         r"4\.\.7$"):
        w = torch.zeros(4, 16)
        w[1, 4:7] = 1.0
        sparse24.pack_sparse24_weight(w)
    with pytest.raises(ValueError, match=r"^18 inputs are not whole groups of 4$"):
        sparse24.pack_sparse24_weight(torch.zeros(4, 18))
    with pytest.raises(ValueError, match=r"^a 2:4 weight is \[out, in\], not \(16,\)$"):
        sparse24.pack_sparse24_weight(torch.zeros(16))
    packed = sparse24.pack_sparse24_weight(sparse_weight(16, 64))
    with pytest.raises(RuntimeError, match="x must be 2-D float32"):
        torch.ops.kvslim.sparse24_mm(torch.zeros(1, 64, dtype=torch.float64), packed.values,
                                     packed.index, 16)
    with pytest.raises(RuntimeError, match="weight shape does not match"):
        torch.ops.kvslim.sparse24_mm(torch.zeros(1, 64), packed.values, packed.index, 40)
    with pytest.raises(RuntimeError, match="weight shape does not match"):
        torch.ops.kvslim.sparse24_mm(torch.zeros(1, 60), packed.values, packed.index, 16)
