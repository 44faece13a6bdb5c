"""Quantized linear kernels as plain functions: INT8 weight-only, 4-bit group-wise weight-only and
W8A8 (dynamic per-token int8 activations), each with a pure-torch fallback (dequantize a chunk
of rows at a time, then torch.mm) for a device, dtype or torch build without the native op.

Where kvslim's own C++ extension builds (kernels/extension.py), 4-bit weights run its group
kernel instead (`Int4Weight.group`, kernels/tiled_gemm.py): float32 activations and one fixed
order of sums per output, so a row's result does not depend on the batch, and faster than the
native int4 op at every M measured (`kvslim bench kernels`, `int4-g<N>.kvslim_group`). What
follows measured torch's kernels, which run without the extension.

Measured with `kvslim bench kernels --threads 1` (AMD EPYC with AVX-512 VNNI, torch 2.13 CPU,
two cores shared with other work, so cells are noisy by ~30% and up to 2x between runs), on
SmolLM2-135M's shapes, µs per call at M = 1 / 8 / 64 rows. The bf16 rows come from a second run
(`--shapes qkv,gate_up,down,lm_head --groups 32 --no-compile --no-torchao --rounds 3`) on busier
cores, where fp32 mm qkv took 67 / 266 / 704 and W8A8 32 / 66 / 124; the rest from the default:

    576->960 (qkv)      fp32 mm 28 / 123 / 679    oneDNN packed 37 / 56 / 295
                        int8pack bf16 36 / 102 / 479   int8pack fp32 354 / 2917 / 24170
                        int4pack bf16 31 / 85 / 427    int4pack fp32 796 / 6460 / 51292
                        int8 dequant+mm 57 / 152 / 728   int4 unpack+dequant+mm 1872 / 3341 / 2573
                        W8A8 torch._int_mm (incl. quantizing x) 18 / 40 / 122
    576->49152 (lm_head) fp32 mm 5064, oneDNN 4283 at M=1; int8pack bf16 1756 / 3826 / 29261;
                        int4pack bf16 1039 / 3169 / 23570; chunked int8 dequant 5815 / 10503 /
                        39506 (whole-weight dequant 57594 at M=1); W8A8 1326 / 3901 / 8912

So:
- int8_linear and int4_linear use torch's native weight-only ops with bfloat16 activations at
  every row count measured (1-64): with float32 activations the same ops run a scalar loop
  10-20x slower, and every pure-torch dequant (also torch.compile'd: 1.1 s to compile, no faster
  than eager for int8, 280 µs for int4 qkv at M=1) is slower than float32. The price is bfloat16
  rounding of x and of the output (about 4e-3 of the largest output, measured).
- w8a8_linear uses torch._int_mm (oneDNN VNNI; any M works on the CPU; on CUDA it needs M > 16
  and multiples of 8, so rows are padded there) at every M: the fastest kernel in the table
  from one row on; a later per-M run against int8 weight-only is at W8A8_MIN_ROWS.
- 4-bit layers keep int4_linear at every M, although it loses to float32's packed kernel from
  about 8 rows (qkv g64: 160 / 738 µs at M = 8 / 64 against 148 / 329; o 178 / 1535 against
  149 / 776; the run of W8A8_MIN_ROWS). Probed for large M (`int4-g<N>.bf16_copy_mm` and
  `.w8a8_per_group_int_mm` in `kvslim bench kernels`), neither wins clearly while keeping
  memory low: a bfloat16 copy of the dequantized weight through oneDNN's bf16 GEMM (this CPU
  has avx512_bf16) beats the int4 op from 16 rows (qkv 122 vs 231 at M = 32, gate_up 2465 vs
  5497 at 64) but stores 2 bytes per weight, 4x the 4-bit form; W8A8 on int8 codes q - zero
  (exact in the weight only with integer zero points, so not for GGUF Q4_1's float minimums)
  needs one torch._int_mm per group, because a per-group scale cannot be applied after one
  integer product over all inputs, and was slower than float32 (qkv 296 vs 148 at M = 8, 441
  vs 329 at 64); it would also quantize the activations of a model whose numerics are
  bfloat16's, per batch size. Dequantizing 256 output rows at a time to bfloat16 for a bf16 mm
  (probed by hand) was 5-10x slower than the int4 op at every M (the nibble unpacking).
- torchao 0.18 imports with torch 2.13, but its int8 weight-only is a dequant+mm (no faster than
  ours), its W8A8 was 5-10x slower than torch._int_mm, and its int4 CPU format is refused.
- The fallback dequantizes CHUNK_ROWS output rows at a time: for lm_head 10x faster than
  dequantizing the whole weight, which goes through memory as float32.

4-bit weights keep two forms (the nibbles for the fallback and dequantize(), torch's CPU packing
for the native op): torch's layout is opaque, so reading it back needs the other.

On CUDA (compute capability 8.0 and up), 4-bit weights run torch's `_weight_int4pack_mm`
(tinygemm, the kernel gpt-fast decodes with): the weight read once at 4 bits, where the
fallback wrote and re-read a bfloat16 copy of every chunk. Measured on the GPU by
benchmarks/cuda_quantized_check.py (its kernel check: error against the dequantized weight, and
whether a row's output depends on the batch)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvslim.kernels import activations, group_q8, tiled_gemm
from kvslim.kernels.group_q8 import Q8GroupWeight
from kvslim.kernels.tiled_gemm import GroupWeight

CHUNK_ROWS = 256              # output rows dequantized at a time by the fallback (stays in cache)
CUDA_INT_MM_MIN_ROWS = 24     # torch._int_mm on CUDA: more than 16 rows, a multiple of 8
# torch's CUDA int4 op (tinygemm, gpt-fast's kernel): tensor-core tiles of 8 outputs by
# inner_k_tiles x 16 inputs, bfloat16 activations, compute capability 8.0 and up.
CUDA_INT4_GROUPS = (32, 64, 128, 256)
CUDA_INT4_INNER_K_TILES = (8, 4, 2)
# From how many rows a W8A8 layer runs the integer product rather than int8 weight-only on the
# same weight: 1, every M. `kvslim bench kernels --threads 1 --no-compile --no-torchao --groups
# 64 --rounds 3 --target-ms 10 --json` ("choices"; busy shared cores, cells noisy up to 2x),
# µs of one decoder layer's four linears (qkv + o + gate_up + down), int8_linear vs
# w8a8_linear: M=1 328 vs 306, M=2 503 vs 675, M=4 1250 vs 641, M=8 1076 vs 762, M=16 2346
# vs 759, M=32 5412 vs 990, M=64 12487 vs 2609. W8A8 wins from 4 rows by 1.4-5x and ties at 1;
# int8 weight-only won only at M=2, by 25% in this one run. Switching kernels by M would
# make a request's tokens depend on how many rows its step has (bfloat16 vs int8
# activations), so one kernel runs at every M and results do not depend on the batch.
W8A8_MIN_ROWS = 1


def q8_weight_of(kernel) -> Q8GroupWeight | None:
    """The int8-activation weight a layer's chosen kernel runs, where it runs one alone, without
    a bias or an input permutation (kernels/decoder_layer.py takes those layers whole)."""
    keywords = getattr(kernel, "keywords", None) or {}
    if keywords.get("bias") is not None or keywords.get("perm") is not None:
        return None
    weight = keywords.get("weight")
    if isinstance(weight, Int4Weight):
        weight = weight.group
    return weight if isinstance(weight, Q8GroupWeight) else None


def _native(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def _on_cpu_float(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight takes {in_features}")
    return x.reshape(-1, in_features).contiguous()


def _chunked_mm(rows: torch.Tensor, out_features: int, dequant_rows) -> torch.Tensor:
    """rows @ W^T with W dequantized CHUNK_ROWS output rows at a time: the float copy of a
    chunk stays in cache instead of a whole float weight going through memory."""
    out = torch.empty(rows.shape[0], out_features, dtype=rows.dtype, device=rows.device)
    for start in range(0, out_features, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, out_features)
        torch.mm(rows, dequant_rows(start, stop, rows.dtype).t(), out=out[:, start:stop])
    return out


def _native_bf16(op, rows: torch.Tensor, *args) -> torch.Tensor:
    """The native weight-only ops are vectorized for bfloat16 activations only (float32 takes
    a scalar loop about 20x slower), so float32 rows go through bfloat16 and back."""
    return op(rows.to(torch.bfloat16), *args).to(rows.dtype)


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out = out.add_(bias.to(out.dtype))
    return out.view(*x.shape[:-1], out.shape[-1])


# --- INT8 weight-only, symmetric per output channel ------------------------------------------

def pack_int8(weight_fp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [out, in] and float32 scales [out] with weight ~= qweight * scales[:, None]."""
    w = weight_fp.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight.contiguous(), scales


def int8_kernel_scales(scales: torch.Tensor) -> torch.Tensor:
    """The form int8_linear wants its scales in, converted once: bfloat16 where the native op
    runs them (CPU), else as they are (the fallback multiplies in the activations' dtype)."""
    if scales.device.type == "cpu" and _native("_weight_int8pack_mm"):
        return scales.to(torch.bfloat16)
    return scales


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ (qweight * scales)^T + bias -> [..., out], in x's dtype."""
    rows = _rows(x, qweight.shape[1])
    if _on_cpu_float(rows) and _native("_weight_int8pack_mm"):
        # Scales given in bfloat16 (int8_kernel_scales) are used as they are: a conversion
        # inside a compiled step is one the compiler cannot lower into the op's call.
        native_scales = scales if scales.dtype == torch.bfloat16 else scales.to(torch.bfloat16)
        out = _native_bf16(torch.ops.aten._weight_int8pack_mm, rows, qweight, native_scales)
    else:
        out = _chunked_mm(rows, qweight.shape[0],
                          lambda a, b, dtype: qweight[a:b].to(dtype)).mul_(scales.to(rows.dtype))
    return _finish(out, x, bias)


# --- 4-bit group-wise, asymmetric: w = (q - zero) * scale per group of inputs -----------------

@dataclass
class Int4Weight:
    """A 4-bit weight packed for int4_linear. `nibbles` holds two values per byte (even input
    in the low nibble); `native`/`native_scales_zeros` are torch's CPU packing when it exists."""
    out_features: int
    in_features: int
    group_size: int
    nibbles: torch.Tensor              # uint8 [out, in // 2]
    scales: torch.Tensor               # float32 [out, in // group]
    zeros_x_scales: torch.Tensor       # zero * scale, float32 [out, in // group]
    native: torch.Tensor | None = None
    # [in // group, out, 2] in bfloat16, the op's form, converted once: a conversion inside a
    # compiled step is one the compiler cannot lower into the op's call.
    native_scales_zeros: torch.Tensor | None = None
    # kvslim's group kernel's form, where it is built (kernels/activations.py chooses which)
    group: GroupWeight | Q8GroupWeight | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0,
                   stop: int | None = None) -> torch.Tensor:
        """Output rows start:stop (default all) as a float weight."""
        nib, sl = self.nibbles[start:stop], slice(start, stop)
        q = torch.stack((nib & 15, nib >> 4), dim=-1).reshape(nib.shape[0], -1, self.group_size)
        w = q.to(dtype) * self.scales[sl, :, None].to(dtype)
        return w.sub_(self.zeros_x_scales[sl, :, None].to(dtype)).reshape(nib.shape[0], -1)


def pack_int4(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, offsets: torch.Tensor | None = None) -> Int4Weight:
    """values [out, in] in 0..15, scales and zeros [out, in // group_size]; `offsets`: the
    group kernel's m where w = q * s + m is not (q - zero) * s (pack_int4_offsets)."""
    out_f, in_f = values.shape
    if in_f % group_size or in_f % 2 or scales.shape != (out_f, in_f // group_size):
        raise ValueError(f"{in_f} inputs, groups of {group_size}, scales {tuple(scales.shape)}")
    q = values.to(torch.int32)
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise ValueError("4-bit values must lie in 0..15")
    scales, zeros = scales.float().contiguous(), zeros.float().contiguous()
    packed = Int4Weight(out_f, in_f, group_size,
                        (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous(),
                        scales, (zeros * scales).contiguous())
    if values.device.type == "cpu" and tiled_gemm.available():
        mins = -packed.zeros_x_scales if offsets is None else offsets.float()
        packed.group = activations.pack(values, scales, mins, 4)
        return packed
    if _native("_convert_weight_to_int4pack_for_cpu") and values.device.type == "cpu":
        packed.native = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    elif (tiles := cuda_int4_tiles(values.device, out_f, in_f, group_size)) is not None:
        # The CUDA op takes two values a byte, the even input in the high nibble.
        packed.native = torch.ops.aten._convert_weight_to_int4pack(
            ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous(), tiles)
    if packed.native is not None:
        # Both ops dequantize (q - 8) * scale + z, so z = (8 - zero) * scale.
        packed.native_scales_zeros = torch.stack(
            (scales, (8 - zeros) * scales), dim=-1
        ).transpose(0, 1).to(torch.bfloat16).contiguous()
    return packed


def cuda_int4_tiles(device: torch.device, out_features: int, in_features: int,
                    group_size: int) -> int | None:
    """The inner_k_tiles torch's CUDA int4 op packs a weight of this shape with, or None where
    it cannot run it (not CUDA, an older GPU, a group or shape outside its tiles)."""
    if (device.type != "cuda" or not _native("_weight_int4pack_mm")
            or torch.cuda.get_device_capability(device) < (8, 0)
            or group_size not in CUDA_INT4_GROUPS or out_features % 8):
        return None
    return next((t for t in CUDA_INT4_INNER_K_TILES if in_features % (t * 16) == 0), None)


def pack_int4_offsets(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                      group_size: int) -> Int4Weight:
    """The same for w = q * scale + offset (llama.cpp's Q4_1 / Q4_K form): an offset cannot
    always be written as a zero point, -offset / scale, because a block's scale may be 0
    (Q4_K sub-block scales are 6-bit integers) while its offset is not."""
    packed = pack_int4(values, scales, torch.zeros_like(scales), group_size, offsets)
    offsets = offsets.float().contiguous()
    packed.zeros_x_scales = -offsets
    if packed.native is not None:
        packed.native_scales_zeros = torch.stack(
            (packed.scales, 8 * packed.scales + offsets), dim=-1
        ).transpose(0, 1).to(torch.bfloat16).contiguous()
    return packed


def int4_linear(x: torch.Tensor, packed: Int4Weight,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = _rows(x, packed.in_features)
    if packed.group is not None and _on_cpu_float(rows):
        out = activations.group_forward(rows, packed.group).to(rows.dtype)
    elif (packed.native is not None and _on_cpu_float(rows)
            and _native("_weight_int4pack_mm_for_cpu")):
        out = _native_bf16(torch.ops.aten._weight_int4pack_mm_for_cpu, rows, packed.native,
                           packed.group_size, packed.native_scales_zeros)
    elif packed.native is not None and rows.is_cuda:
        out = _native_bf16(torch.ops.aten._weight_int4pack_mm, rows, packed.native,
                           packed.group_size, packed.native_scales_zeros)
    else:
        out = _chunked_mm(rows, packed.out_features,
                          lambda a, b, dtype: packed.dequantize(dtype, a, b))
    return _finish(out, x, bias)


# --- W8A8: per-token int8 activations x per-channel int8 weights -----------------------------

def quantize_per_token(x: torch.Tensor, amax: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and float32 [rows, 1] scales, symmetric, from each row's largest magnitude
    (`amax` [rows, 1] when it spans more columns than x holds: a tensor-parallel row shard)."""
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    sx = (amax.float() / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(xf / sx).clamp(-127, 127).to(torch.int8), sx


def pack_w8a8(qweight: torch.Tensor, scales: torch.Tensor) -> Q8GroupWeight | None:
    """kvslim's VNNI form of a W8A8 weight (group_q8.w8a8_mm), where it runs: a CPU weight
    and the extension built on a CPU with AVX-512 VNNI."""
    if (qweight.device.type == "cpu" and group_q8.available()
            and group_q8.w8a8_usable(qweight.shape[1])):
        return group_q8.pack_w8a8_weight(qweight, scales)
    return None


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, amax: torch.Tensor | None = None,
                packed: Q8GroupWeight | None = None) -> torch.Tensor:
    """Quantizes each row of x to int8 (its scale from `amax` when given, see
    `quantize_per_token`), multiplies in integers, rescales to x's dtype. `packed`
    (pack_w8a8) runs kvslim's kernel, whose outputs are these same bits."""
    rows = _rows(x, qweight.shape[1])
    if packed is not None and _on_cpu_float(rows):
        return _finish(group_q8.w8a8_mm(rows, packed, amax).to(rows.dtype), x, bias)
    xq, sx = quantize_per_token(rows, amax)
    acc = _int_mm(xq, qweight)
    if acc is None:             # exact while |sums| < 2^24, float rounding beyond
        acc = F.linear(xq.float(), qweight.float())
    out = acc.float().mul_(sx).mul_(scales.float()).to(rows.dtype)
    return _finish(out, x, bias)


def _int_mm(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor | None:
    """xq [M, in] @ qweight^T in int32, or None where torch._int_mm cannot run it. On CUDA it
    needs more than 16 rows and in and out multiples of 8: fewer rows are padded with zero rows
    (each output row depends on its own input row only, so the padding changes nothing)."""
    if not hasattr(torch, "_int_mm"):
        return None
    if xq.device.type == "cpu":
        return torch._int_mm(xq, qweight.t())
    if xq.device.type != "cuda" or xq.shape[1] % 8 or qweight.shape[0] % 8:
        return None
    return padded_int_mm(xq, qweight)


def padded_int_mm(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """torch._int_mm over xq padded with zero rows to CUDA's row rule, the padding cut off."""
    m = xq.shape[0]
    padded = max(CUDA_INT_MM_MIN_ROWS, -(-m // 8) * 8)
    if padded != m:
        xq = torch.cat((xq, xq.new_zeros(padded - m, xq.shape[1])))
    return torch._int_mm(xq, qweight.t())[:m]
