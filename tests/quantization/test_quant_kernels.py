"""Quantized linear kernels against plain torch on the dequantized weights, every row count
1..64, with and without bias, 2-D and 3-D inputs.

Bounds, as max |out - ref| / max |ref| with ref = F.linear in float32 on the dequantized weight:
- NATIVE_RTOL 1e-2 for int8_linear/int4_linear on the native ops: they take bfloat16 activations
  and return bfloat16 (2^-9 relative rounding each; measured about 4e-3);
- EXACT_RTOL 1e-4 for the pure-torch fallbacks and for W8A8 (whose reference quantizes the
  activations the same way): the same products summed in another order."""
import pytest
import torch
import torch.nn.functional as F

from kvslim.quantization import kernels as qk

# against the dequantized weight in float32: the exact reference kernels
pytestmark = pytest.mark.usefixtures("float32_activations")

IN, OUT, GROUP = 128, 96, 32
ROWS = list(range(1, 65))
NATIVE_RTOL, EXACT_RTOL = 1e-2, 1e-4


def close(out, ref, rtol=EXACT_RTOL):
    err = float((out - ref).abs().max())
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert err <= rtol * float(ref.abs().max()) + 1e-5, err / float(ref.abs().max())


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(qk, "_native", lambda name: False)
    monkeypatch.delattr(torch, "_int_mm")


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, IN, generator=g) / IN ** 0.5
    values = torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.uint8)
    scales = torch.rand(OUT, IN // GROUP, generator=g) * 0.02 + 1e-3
    zeros = torch.rand(OUT, IN // GROUP, generator=g) * 15
    return w, torch.randn(OUT, generator=g), values, scales, zeros


def inputs(rows, three_d):
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    return x.view(1, rows, IN) if three_d else x


def test_pack_int8_is_symmetric_per_channel(weights):
    w = weights[0]
    q, s = qk.pack_int8(w)
    assert q.dtype == torch.int8 and q.shape == (OUT, IN) and s.shape == (OUT,)
    assert int(q.abs().amax(1).min()) == 127
    assert torch.allclose(q.float() * s[:, None], w, atol=float(s.max()) / 2 + 1e-7)


@pytest.mark.parametrize("three_d", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear(weights, with_bias, three_d):
    w, b = weights[0], weights[1] if with_bias else None
    q, s = qk.pack_int8(w)
    w_deq = q.float() * s[:, None]
    for rows in ROWS:
        x = inputs(rows, three_d)
        close(qk.int8_linear(x, q, s, b), F.linear(x, w_deq, b), NATIVE_RTOL)


def dequant4(values, scales, zeros):
    v = values.float().view(OUT, -1, GROUP)
    return ((v - zeros[..., None]) * scales[..., None]).view(OUT, IN)


@pytest.mark.parametrize("three_d", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear(weights, with_bias, three_d):
    _, b, values, scales, zeros = weights
    b = b if with_bias else None
    packed = qk.pack_int4(values, scales, zeros, GROUP)
    w_deq = dequant4(values, scales, zeros)
    assert torch.allclose(packed.dequantize(), w_deq, atol=1e-6)
    for rows in ROWS:
        x = inputs(rows, three_d)
        close(qk.int4_linear(x, packed, b), F.linear(x, w_deq, b), NATIVE_RTOL)


@pytest.mark.parametrize("three_d", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_linear(weights, with_bias, three_d):
    w, b = weights[0], weights[1] if with_bias else None
    q, s = qk.pack_int8(w)
    w_deq = q.float() * s[:, None]
    for rows in ROWS:
        x = inputs(rows, three_d)
        xq, sx = qk.quantize_per_token(x)
        close(qk.w8a8_linear(x, q, s, b), F.linear(xq.float() * sx, w_deq, b))


@pytest.mark.parametrize("with_bias", [False, True])
def test_fallbacks_without_native_ops(weights, no_native, with_bias):
    """With the native ops hidden, every function takes its pure-torch path (chunked dequant,
    float-emulated W8A8): float32 results within EXACT_RTOL, for weights over one chunk too."""
    w, b, values, scales, zeros = weights
    b = b if with_bias else None
    q, s = qk.pack_int8(w)
    packed = qk.pack_int4(values, scales, zeros, GROUP)
    assert packed.native is None
    w8, w4 = q.float() * s[:, None], dequant4(values, scales, zeros)
    for rows in (1, 2, 5, 17, 64):
        x = inputs(rows, rows % 2 == 1)
        xq, sx = qk.quantize_per_token(x)
        close(qk.int8_linear(x, q, s, b), F.linear(x, w8, b))
        close(qk.int4_linear(x, packed, b), F.linear(x, w4, b))
        close(qk.w8a8_linear(x, q, s, b), F.linear(xq.float() * sx, w8, b))


def test_chunked_fallback_covers_every_output_row(no_native, monkeypatch):
    monkeypatch.setattr(qk, "CHUNK_ROWS", 40)              # 96 rows: chunks of 40, 40, 16
    w = torch.randn(OUT, IN)
    q, s = qk.pack_int8(w)
    x = torch.randn(3, IN)
    close(qk.int8_linear(x, q, s), F.linear(x, q.float() * s[:, None]))


def test_bad_inputs_are_refused(weights):
    _, _, values, scales, zeros = weights
    with pytest.raises(ValueError):
        qk.pack_int4(values, scales, zeros, 48)
    with pytest.raises(ValueError):
        qk.pack_int4(values.int() + 1, scales, zeros, GROUP)
    q, s = qk.pack_int8(weights[0])
    with pytest.raises(ValueError):
        qk.int8_linear(torch.randn(2, IN + 1), q, s)


def test_cuda_int4_op_is_chosen_only_where_its_tiles_fit(monkeypatch):
    """torch's CUDA int4 op (tinygemm): compute capability 8.0+, groups of 32-256, outputs in
    eights, inputs in its inner tiles of 16 (the widest that divides them)."""
    from kvslim.quantization.kernels import cuda_int4_tiles
    cuda = torch.device("cuda")
    assert cuda_int4_tiles(torch.device("cpu"), 2048, 2048, 32) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cuda_int4_tiles(cuda, 2048, 2048, 32) == 8
    assert cuda_int4_tiles(cuda, 2048, 96, 32) == 2          # 96 = 2 x 16 x 3, not 4 x 16
    assert cuda_int4_tiles(cuda, 2048, 192, 64) == 4
    assert cuda_int4_tiles(cuda, 2048, 2048, 16) is None      # a group the op does not take
    assert cuda_int4_tiles(cuda, 2044, 2048, 32) is None      # outputs not in eights
    assert cuda_int4_tiles(cuda, 2048, 40, 40) is None        # no tile divides the inputs
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert cuda_int4_tiles(cuda, 2048, 2048, 32) is None
