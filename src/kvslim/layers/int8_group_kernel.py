"""The kernel for group-wise int8 weights (GGUF Q8_0: groups of 32 with a scale each; Q6_K:
6-bit values as int8 q - 32 with a scale per group of 16): w[o, i] = q[o, i] * s[o, i // group].

Candidates measured with `kvslim bench kernels --shapes qkv,down,lm_head --groups 32 --int8-groups`
(AMD EPYC with AVX-512 VNNI and avx512_bf16, torch 2.13 CPU, one thread, two cores shared with
other work, so cells are noisy by ~30%), µs per call at M = 1 / 8 rows:

    576->49152 (lm_head)  dequantized once to float32, F.linear   7396 / 12745   exact
                          dequantized once to bfloat16, bf16 mm   3623 / 4456    weights rounded
                                                                                 to bf16, output
                                                                                 error 3.8e-3
                          per-channel int8 requant,               1784 / 3879    weights moved to
                            torch's _weight_int8pack_mm                          a per-row grid:
                                                                                 3.9e-3 of max|w|,
                                                                                 output 9.4e-3
                          chunked dequant + mm (no stored copy)   ~5800 (quant_kernels' table)
    576->960 (qkv)        float32 35 / 134, bfloat16 50 / 64, per-channel int8 19 / 64
    1536->576 (down)      float32 46 / 209, bfloat16 71 / 90, per-channel int8 27 / 88
(errors: max abs error / max abs reference, against F.linear over the block weights in float32)

So every fast candidate rounds: the per-channel requantization moves every weight to a grid of
row max / 127, coarser than the file's own grid of block max / 127 (Q8_0) or group max / 31
(Q6_K), adding about as much error again as the file's quantization; and bfloat16 (both the
native int8 op and a bf16 matmul) also rounds its output to 8 bits of mantissa, which for the LM
head means logits near 25 come back in steps of 0.125. That is not noise: SmolLM2's greedy
answer to "What is the capital of France?" starts with "The" by a float32 margin of 0.08 over
"L", and the bfloat16 head (3.6 ms) answered "L'Étoile, la Marseillaise," where the float32 head
(7.4 ms) answers "The capital of France is Paris." (torch 2.13 has no bf16 x bf16 -> float32 mm
on the CPU). So the kernel is the exact one: the weight dequantized once to float32 and F.linear,
as fast as the float model's own layer and no slower; the int8 form is kept for reading back
(checkpoint tensors, the embedding rows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Int8GroupWeight:
    """int8 values [out, in] and float32 scales [out, in // group], kept for reading back; `dense`
    is the form the kernel multiplies with (see the module docstring)."""
    values: torch.Tensor
    scales: torch.Tensor
    group: int
    dense: torch.Tensor

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
    return Int8GroupWeight(values.contiguous(), scales.float().contiguous(), group, w)


def int8_group_linear(x: torch.Tensor, weight: Int8GroupWeight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w^T + bias in x's dtype."""
    if weight.dense.dtype == x.dtype:
        return F.linear(x, weight.dense, bias)
    out = F.linear(x.to(weight.dense.dtype), weight.dense).to(x.dtype)
    return out if bias is None else out + bias.to(out.dtype)
