"""The group-wise int8 kernel (GGUF Q8_0 / Q6_K) computes F.linear over the exact block weights:
float32 in and out, only the summation order may differ (oneDNN), so within 1e-5 relative."""
import pytest
import torch
import torch.nn.functional as F

from kvslim.quantization.int8_group_kernel import (dequantize_int8_group, int8_group_linear,
                                             pack_int8_group)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("rows", [1, 5])
def test_matches_the_block_weights(group, rows):
    g = torch.Generator().manual_seed(group + rows)
    values = torch.randint(-128, 128, (48, 96), generator=g).to(torch.int8)
    scales = torch.rand(48, 96 // group, generator=g) * 1e-2
    bias = torch.randn(48, generator=g)
    weight = pack_int8_group(values, scales, group)
    w = values.float().view(48, -1, group) * scales[..., None]
    assert torch.equal(dequantize_int8_group(values, scales, group), w.view(48, 96))
    x = torch.randn(2, rows, 96, generator=g)
    ref = F.linear(x, w.view(48, 96), bias)
    out = int8_group_linear(x, weight, bias)
    assert out.shape == (2, rows, 48) and out.dtype == torch.float32
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    half = int8_group_linear(x.bfloat16(), weight, bias)
    assert half.dtype == torch.bfloat16


def test_bad_scales_shape():
    with pytest.raises(ValueError, match="96 inputs, groups of 32"):
        pack_int8_group(torch.zeros(4, 96, dtype=torch.int8), torch.zeros(4, 2), 32)
