"""GPTQLinear after prepare_for_inference: the int4 kernel (groups in order, act-order
permutations, v1 zero points of 16), the int8 kernel (8 bits, one symmetric group per output
channel) and the dequantize-once path for everything else compute the layer's dequantized
weight: within float32 rounding in kvslim's own kernels, within the bfloat16 bound in torch's
(without the extension)."""
import pytest
import torch
import torch.nn.functional as F

from kvslim.formats.gptq import QuantizedWeight, pack_gptq
from kvslim.kernels import tiled_gemm
from kvslim.quantization import QuantSpec
from kvslim.quantization.gptq import GPTQLinear

# against the dequantized weight in float32: the exact reference kernels
pytestmark = pytest.mark.usefixtures("float32_activations")

IN, OUT = 128, 48


def layer(bits, group, act_order, fmt, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    top, groups = 2 ** bits, IN // group if group > 0 else 1
    g_idx = (torch.arange(IN) // (group if group > 0 else IN)).to(torch.int32)
    if act_order:
        g_idx = g_idx[torch.randperm(IN, generator=gen)]
    w = QuantizedWeight(q=torch.randint(0, top, (OUT, IN), generator=gen),
                        zeros=(torch.full((groups, OUT), top // 2) if group == -1
                               else torch.randint(1, top, (groups, OUT), generator=gen)),
                        scales=(torch.rand(groups, OUT, generator=gen) + 0.5) / top,
                        g_idx=g_idx)
    spec = QuantSpec(bits, group, act_order, False, fmt)
    module = GPTQLinear(IN, OUT, bias=bias, spec=spec)
    with torch.no_grad():
        for name, tensor in pack_gptq(w, spec).items():
            target = module.g_idx[0] if name == "g_idx" else getattr(module, name)
            target.copy_(tensor)
        if bias:
            module.bias.copy_(torch.randn(OUT, generator=gen))
    return module


@pytest.mark.parametrize("bits,group,act_order,fmt", [
    (4, 32, False, "gptq"), (4, 32, True, "gptq_v2"), (4, 64, True, "gptq"),
    (8, 32, False, "gptq"), (8, 64, True, "gptq_v2"), (8, -1, False, "gptq"),
    (8, -1, True, "gptq_v2")])
@pytest.mark.parametrize("bias", [False, True])
def test_prepared_kernel_computes_the_dequantized_weight(bits, group, act_order, fmt, bias):
    module = layer(bits, group, act_order, fmt, bias)
    x = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, module.dequantized_weight().float(), module.bias)
    module.prepare_for_inference()
    ours = tiled_gemm.available()            # kvslim's kernels: float32 activations
    per_channel = "group_forward" if ours else "int8_linear"
    kernel = {4: "_int4_forward", 8: per_channel if group == -1 else "_dense_forward"}[bits]
    assert module.kernel.func.__name__ == kernel
    got = module(x)
    assert got.shape == ref.shape
    exact = ours or kernel == "_dense_forward"
    assert (got - ref).abs().max() <= (1e-5 if exact else 1e-2) * ref.abs().max()  # else bf16


def test_v1_zero_of_sixteen_is_kept_by_the_int4_kernel():
    module = layer(4, 32, False, "gptq", False)
    with torch.no_grad():
        module.qzeros.fill_(-1)                     # every stored nibble 15: zero points of 16
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(2))
    ref = F.linear(x, module.dequantized_weight().float())
    module.prepare_for_inference()
    assert (module(x) - ref).abs().max() <= 1e-2 * ref.abs().max()
