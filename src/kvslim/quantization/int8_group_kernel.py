"""The kernel for group-wise int8 weights (GGUF Q8_0: groups of 32 with a scale each; Q5_0:
5-bit values as int8 q - 16, the same groups; Q6_K: 6-bit values as int8 q - 32 with a scale per
group of 16): w[o, i] = q[o, i] * s[o, i // group].

Candidates measured with `kvslim bench kernels --shapes qkv,down,lm_head --groups 32 --batches
1,8 --rounds 2 --no-compile --no-torchao --threads 1` (AMD EPYC with AVX-512 VNNI and
avx512_bf16, torch 2.13 CPU, two cores shared with three other CPU-heavy processes, so cells are
noisy by 30% and more), µs per call at M = 1 / 8 rows, group 32 (group 16 within noise), and
max |out - ref| / max |ref| against F.linear over the exact block weights:

                         dequant once    dequant once    dequant once   chunked    per-channel
                         fp32 F.linear   fp32 oneDNN     bf16 mm        dequant    int8 requant,
                                         packed                                    int8pack bf16
    576->960 (qkv)       53 / 226        63 / 92         71 / 90        200 / 357  25 / 98
    1536->576 (down)     89 / 438        91 / 154        119 / 184      329 / 765  40 / 175
    576->49152 (lm_head) 12923 / 30554   8164 / 8967     7679 / 10055   15807 /    4109 / 8579
                                                                        26649
    error                0               9e-7            3.4e-3         0          1.1e-2

(the oneDNN column is the float model's own kernel, fp32.onednn_packed, on the same weights.)
Every faster candidate rounds: the per-channel requantization moves each weight to a grid of
row max / 127, coarser than the file's own block max / 127 (Q8_0) or group max / 31 (Q6_K),
adding about as much error again as the file's quantization; bfloat16 (the native int8 op and a
bf16 matmul alike) also rounds its output to 8 bits of mantissa: LM-head logits near 25 come
back in steps of 0.125. That is not noise: SmolLM2's greedy answer to "What is the capital of
France?" starts with "The" by a float32 margin of 0.08 over "L", and with a bfloat16 head it
answered "L'Étoile, la Marseillaise," instead of "The capital of France is Paris." (torch 2.13
has no bf16 x bf16 -> float32 matmul on the CPU). So the kernel is the exact one: the weight
dequantized once to float32 and run by oneDNN prepacked (layers/cpu_linear.py, without its
second, GEMV copy: that would double the LM head's 113 MB), F.linear off the CPU or for other
dtypes. It costs what the float model's layer costs; the int8 form is kept for reading back
(checkpoint tensors, the embedding rows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvslim.layers.cpu_linear import PackedCpuKernel, packed_linear_available


@dataclass
class Int8GroupWeight:
    """int8 values [out, in] and float32 scales [out, in // group], kept for reading back, and
    the float32 weight the kernel multiplies with: oneDNN's packed form on the CPU (`packed`),
    else `dense` (see the module docstring)."""
    values: torch.Tensor
    scales: torch.Tensor
    group: int
    dense: torch.Tensor | None
    packed: PackedCpuKernel | None = None      # oneDNN's prepacked float32 dense, on the CPU

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8_group(self.values, self.scales, self.group).to(dtype)


def dequantize_int8_group(values: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [out, in]: exact (|q| <= 128 times a float32 scale of at most 18 bits)."""
    out = values.shape[0]
    w = values.float().view(out, -1, group) * scales.float().unsqueeze(-1)
    return w.view(out, -1)


def pack_int8_group(values: torch.Tensor, scales: torch.Tensor, group: int) -> Int8GroupWeight:
    if values.shape[1] % group or scales.shape != (values.shape[0], values.shape[1] // group):
        raise ValueError(f"{values.shape[1]} inputs, groups of {group}, scales "
                         f"{tuple(scales.shape)}")
    w = dequantize_int8_group(values, scales, group)
    values, scales = values.contiguous(), scales.float().contiguous()
    if values.device.type == "cpu" and packed_linear_available():
        return Int8GroupWeight(values, scales, group, None, PackedCpuKernel(w, None, False))
    return Int8GroupWeight(values, scales, group, w)


def int8_group_linear(x: torch.Tensor, weight: Int8GroupWeight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w^T + bias in x's dtype."""
    if weight.packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        out = weight.packed(x)
        return out if bias is None else out + bias
    dense = weight.dense if weight.dense is not None else weight.dequantize()
    return F.linear(x, dense.to(x.dtype), None if bias is None else bias.to(x.dtype))
