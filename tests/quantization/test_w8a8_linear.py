"""W8A8 layers: the output is the plain-torch reference (per-token int8 x, integer product,
rescale) exactly, rows do not depend on their batch, and fused shards keep their own scales."""
import pytest
import torch

from kvslim.kernels import group_q8
from kvslim.quantization.kernels import w8a8_linear
from kvslim.quantization import QuantSpec
from kvslim.quantization.w8a8 import W8A8_SPEC, W8A8Linear
from kvslim.errors import ConfigError


def reference(x, qweight, scales):
    """Written from the definition only: symmetric per-row int8 of x, exact integer sums in
    int64, then x's scale times the weight's."""
    sx = x.abs().amax(dim=-1, keepdim=True) / 127
    xq = torch.round(x / sx).clamp(-127, 127).long()
    acc = xq @ qweight.long().t()
    return acc.double() * sx.double() * scales.double()


def random_layer(in_f, shard_sizes, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    layer = W8A8Linear(in_f, 0, bias, W8A8_SPEC, shard_sizes)
    with torch.no_grad():
        for key, size in shard_sizes.items():
            layer.shard_view("weight", key).copy_(
                torch.randint(-127, 128, (size, in_f), generator=g, dtype=torch.int8))
            layer.shard_view("weight_scale", key).copy_(torch.rand(size, 1, generator=g) / 100)
        if bias:
            layer.bias.copy_(torch.randn(layer.out_features, generator=g))
    return layer


@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_output_is_the_integer_reference(rows):
    layer = random_layer(96, {"q": 64, "k": 16, "v": 16})
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 3
    want = reference(x, layer.weight, layer.weight_scale.view(-1))
    for prepared in (False, True):
        if prepared:
            layer.prepare_for_inference()
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        assert ((got.double() - want).abs() / want.abs().max()).max().item() < 1e-6


def test_a_prepared_cpu_layer_runs_kvslims_kernel_where_it_is_built():
    """Its VNNI form where the extension has it, torch._int_mm's path (the same bits) without."""
    layer = random_layer(96, {"q": 64, "k": 16, "v": 16}, bias=True)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4))
    unprepared = layer(x)
    layer.prepare_for_inference()
    assert (layer.kernel.keywords["packed"] is not None) == group_q8.available()
    assert torch.equal(layer(x), unprepared)


def test_rows_do_not_depend_on_the_batch():
    layer = random_layer(64, {None: 48})
    layer.prepare_for_inference()
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(1))
    together = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(20)])
    assert torch.equal(together, alone)


def test_shards_keep_their_scales_and_bias_is_added():
    layer = random_layer(32, {"gate": 24, "up": 24}, bias=True)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    for key, cols in (("gate", slice(0, 24)), (1, slice(24, 48))):
        w, s = layer.shard_view("weight", key), layer.shard_view("weight_scale", key).view(-1)
        want = w8a8_linear(x, w, s, layer.bias[cols])
        assert torch.equal(out[:, cols], want)
    assert torch.allclose(layer.dequantized_weight(), layer.weight.float() * layer.weight_scale)


def test_dtype_moves_leave_the_int8_weight():
    layer = random_layer(16, {None: 8}).to(torch.bfloat16)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.bfloat16
    assert layer(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_config_is_parsed_and_what_is_not_read_is_named():
    cfg = W8A8_SPEC.to_hf()
    assert QuantSpec.from_hf(cfg) == W8A8_SPEC
    bad = W8A8_SPEC.to_hf()
    bad["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ConfigError, match=r"config_groups.group_0.input_activations.dynamic is "
                                          r"False; kvslim reads True"):
        QuantSpec.from_hf(bad)
    bad = W8A8_SPEC.to_hf()
    bad["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    with pytest.raises(ConfigError, match="weights.strategy is 'tensor'"):
        QuantSpec.from_hf(bad)
    bad = W8A8_SPEC.to_hf()
    del bad["config_groups"]["group_0"]["input_activations"]
    with pytest.raises(ConfigError, match="input_activations is missing"):
        QuantSpec.from_hf(bad)
    with pytest.raises(ConfigError, match="format 'float-quantized' is not supported"):
        QuantSpec.from_hf({**W8A8_SPEC.to_hf(), "format": "float-quantized"})


@pytest.mark.parametrize("rows", [1, 16, 17, 25])
def test_padding_for_cuda_int_mm_changes_no_row(rows):
    """CUDA's torch._int_mm wants more than 16 rows, a multiple of 8: the padded product (run
    here on the CPU) is the unpadded one, row for row."""
    from kvslim.quantization.kernels import padded_int_mm
    g = torch.Generator().manual_seed(rows)
    xq = torch.randint(-127, 128, (rows, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8)
    got = padded_int_mm(xq, w)
    assert got.shape == (rows, 40) and torch.equal(got, xq.long().mm(w.long().t()).int())
