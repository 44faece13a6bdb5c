"""The linear-layer kernels `kvslim bench kernels` compares: float32, INT8 weight-only, 4-bit
group-wise, W8A8, each built from one float weight and checked against its own reference.

A candidate's reference is F.linear over the weight it really computes with (the dequantized
one, and for W8A8 the dequantized activations too), so a candidate that disagrees with it by
more than its `rtol` (max abs error / max abs reference) computes the wrong thing; quantization
error itself is not measured here. torchao quantizes with its own scales, so its candidates are
held to the float weight with a bound that covers quantization error."""
from __future__ import annotations

import importlib.util
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from kvslim.kernels import group_q8, tiled_gemm

Fn = Callable[[torch.Tensor], torch.Tensor]
ONEDNN_BATCH_HINT = 64           # as kvslim.layers.cpu_linear
BF16_RTOL = 1e-2
CHUNK_ROWS = 256                 # output rows dequantized at a time by the chunked variant


@dataclass
class Candidate:
    name: str                    # family.kernel
    family: str                  # fp32, int8, int4-g<N>, w8a8
    weight_bytes: int            # bytes a call reads for the weight (its stored form)
    fn: Fn
    reference: Fn
    rtol: float = 1e-4
    compile_s: float | None = None      # first-call (compile) time, for compiled candidates
    first_call: bool = field(default=True, repr=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.first_call and self.compile_s is not None:
            t = time.perf_counter()
            out = self.fn(x)
            self.compile_s = time.perf_counter() - t
            self.first_call = False
            return out
        return self.fn(x)


# --- quantization (plain torch, the same conventions as kvslim.quantization.kernels) ----------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def quantize_int4(w: torch.Tensor, group: int):
    """Asymmetric 4-bit: values 0..15, dequant (q - zero) * scale per group of `group` inputs."""
    g = w.reshape(w.shape[0], -1, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = -lo / scales
    q = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, 15)
    return q.to(torch.uint8).reshape(w.shape), scales, zeros


def dequant_int4(q, scales, zeros, group):
    g = q.reshape(q.shape[0], -1, group).float()
    return ((g - zeros[..., None]) * scales[..., None]).reshape(q.shape)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 activations and their [rows, 1] scales."""
    sx = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-8)
    return torch.round(x / sx).clamp(-127, 127).to(torch.int8), sx


def _bf16_input_ref(w_deq: torch.Tensor) -> Fn:
    """The native int8/int4 ops are vectorized for bfloat16 activations only (float32 takes a
    scalar loop): those candidates are checked against float math on x rounded to bfloat16,
    with BF16_RTOL for the bfloat16 scales (int4: zeros) and output rounding (2^-9 relative)."""
    return lambda x: F.linear(x.bfloat16().float(), w_deq)


# --- candidates ------------------------------------------------------------------------------

def fp32_candidates(w: torch.Tensor) -> list[Candidate]:
    out_f, in_f = w.shape
    ref: Fn = lambda x: F.linear(x, w)                               # noqa: E731
    w_in_out = w.t().contiguous()
    nbytes = w.numel() * 4
    cands = [Candidate("fp32.F.linear", "fp32", nbytes, ref, ref),
             Candidate("fp32.mm_in_out", "fp32", nbytes, lambda x: torch.mm(x, w_in_out), ref)]
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT)
        cands.append(Candidate("fp32.onednn_packed", "fp32", nbytes, lambda x: torch.ops.mkldnn.
                               _linear_pointwise(x, packed, None, "none", [], ""), ref))
    if tiled_gemm.available():
        tiled = tiled_gemm.pack_float_weight(w)
        cands.append(Candidate("fp32.kvslim_tiled", "fp32", nbytes,
                               lambda x: tiled_gemm.float_linear(x, tiled), ref))
    return cands


def _chunked_dequant_mm(q: torch.Tensor, scales: torch.Tensor) -> Fn:
    """Dequantize CHUNK_ROWS output rows at a time into a small buffer that stays in cache."""
    def fn(x):
        out = torch.empty(x.shape[0], q.shape[0])
        buf = torch.empty(CHUNK_ROWS, q.shape[1])
        for start in range(0, q.shape[0], CHUNK_ROWS):
            rows = min(CHUNK_ROWS, q.shape[0] - start)
            b = buf[:rows].copy_(q[start:start + rows])
            torch.mm(x, b.t(), out=out[:, start:start + rows])
        return out.mul_(scales)
    return fn


def int8_candidates(w: torch.Tensor, compile_: bool) -> list[Candidate]:
    q, s = quantize_int8(w)
    w_deq = q.float() * s[:, None]
    ref: Fn = lambda x: F.linear(x, w_deq)                            # noqa: E731
    nbytes = q.numel() + s.numel() * 4
    q_in_out = q.t().contiguous()
    dequant: Fn = lambda x: F.linear(x, q.float() * s[:, None])       # noqa: E731
    cands = [
        Candidate("int8.dequant_linear", "int8", nbytes, dequant, ref),
        Candidate("int8.linear_then_scale", "int8", nbytes,
                  lambda x: F.linear(x, q.float()) * s, ref),
        Candidate("int8.mm_in_out_then_scale", "int8", nbytes,
                  lambda x: torch.mm(x, q_in_out.float()) * s, ref),
        Candidate("int8.chunked_dequant", "int8", nbytes, _chunked_dequant_mm(q, s), ref),
    ]
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        s16 = s.bfloat16()
        cands += [Candidate("int8.weight_int8pack_mm", "int8", nbytes,
                            lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s), ref),
                  Candidate("int8.weight_int8pack_mm_bf16", "int8", nbytes, lambda x: torch.ops.
                            aten._weight_int8pack_mm(x.bfloat16(), q, s16).float(),
                            _bf16_input_ref(w_deq), rtol=BF16_RTOL)]
    if compile_:
        def deq(x, q, s):
            return F.linear(x, q.to(x.dtype) * s[:, None])
        compiled = torch.compile(deq, dynamic=True)
        cands.append(Candidate("int8.compiled_dequant", "int8", nbytes,
                               lambda x: compiled(x, q, s), ref, compile_s=0.0))
    return cands


INT8_GROUPS = (32, 16)           # GGUF Q8_0 and Q6_K (quantization/int8_group_kernel.py)
REQUANT_RTOL = 5e-2              # the per-channel requantization's own error, reported as err


def int8_group_candidates(w: torch.Tensor, group: int) -> list[Candidate]:
    """Group-wise int8 weights (one float scale per `group` inputs, as GGUF Q8_0 / Q6_K decode)
    and the ways to run them; the reference is F.linear over those exact block weights, so the
    per-channel requantization's err column is the error it adds to the file's own."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, -1, group)
    d = (g.abs().amax(-1) / 127).half().float().clamp(min=1e-8)
    q = torch.round(g / d[..., None]).clamp(-127, 127).to(torch.int8)
    w_deq = (q.float() * d[..., None]).reshape(out_f, in_f)
    ref: Fn = lambda x: F.linear(x, w_deq)                            # noqa: E731
    fam, nbytes = f"int8-g{group}", q.numel() + d.numel() * 4
    w_bf16 = w_deq.bfloat16()

    def chunked(x):
        out = torch.empty(x.shape[0], out_f)
        for start in range(0, out_f, CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, out_f))
            part = (q[rows].float() * d[rows, :, None]).reshape(-1, in_f)
            torch.mm(x, part.t(), out=out[:, rows])
        return out

    cands = [Candidate(f"{fam}.dequant_fp32", fam, nbytes, lambda x: F.linear(x, w_deq), ref),
             Candidate(f"{fam}.dequant_bf16", fam, nbytes,
                       lambda x: F.linear(x.bfloat16(), w_bf16).float(), ref, rtol=BF16_RTOL),
             Candidate(f"{fam}.chunked_dequant", fam, nbytes, chunked, ref)]
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        qc, sc = quantize_int8(w_deq)
        sc16 = sc.bfloat16()
        cands.append(Candidate(f"{fam}.requant_int8pack_bf16", fam, qc.numel() + sc.numel() * 4,
                               lambda x: torch.ops.aten._weight_int8pack_mm(
                                   x.bfloat16(), qc, sc16).float(), ref, rtol=REQUANT_RTOL))
    return cands + kvslim_group_candidates(fam, nbytes, ref, q.view(out_f, in_f), d, None, 8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def int4_candidates(w: torch.Tensor, group: int, compile_: bool) -> list[Candidate]:
    q, scales, zeros = quantize_int4(w, group)
    w_deq = dequant_int4(q, scales, zeros, group)
    ref: Fn = lambda x: F.linear(x, w_deq)                            # noqa: E731
    fam = f"int4-g{group}"
    nbytes = q.numel() // 2 + scales.numel() * 8
    nib = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()              # two values per byte
    zs = zeros * scales

    def unpack_dequant(x, nib, scales, zs):
        v = _unpack_nibbles(nib).to(x.dtype).view(nib.shape[0], -1, group)
        return F.linear(x, (v * scales[..., None] - zs[..., None]).view(nib.shape[0], -1))
    cands = [Candidate(f"{fam}.unpack_dequant", fam, nbytes,
                       lambda x: unpack_dequant(x, nib, scales, zs), ref)]
    if hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # The op dequantizes (q - 8) * scale + zero: zero = (8 - our zero) * scale.
        sz = torch.stack((scales, (8 - zeros) * scales), dim=-1).transpose(0, 1).contiguous()
        sz16 = sz.bfloat16()
        cands += [Candidate(f"{fam}.int4pack_mm_for_cpu", fam, nbytes, lambda x: torch.ops.
                            aten._weight_int4pack_mm_for_cpu(x, packed, group, sz), ref),
                  Candidate(f"{fam}.int4pack_mm_for_cpu_bf16", fam, nbytes,
                            lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
                                x.bfloat16(), packed, group, sz16).float(),
                            _bf16_input_ref(w_deq), rtol=BF16_RTOL)]
    if compile_:
        compiled = torch.compile(unpack_dequant, dynamic=True)
        cands.append(Candidate(f"{fam}.compiled_unpack_dequant", fam, nbytes,
                               lambda x: compiled(x, nib, scales, zs), ref, compile_s=0.0))
    cands += kvslim_group_candidates(fam, nbytes, ref, q, scales, -zs, 4)
    return cands + int4_large_m_candidates(q, scales, zeros, group, w_deq)


def kvslim_group_candidates(fam, nbytes, ref, q, scales, mins, bits) -> list[Candidate]:
    """kvslim's own group kernels on the same weight, where they build: float32 activations
    (kernels/tiled_gemm.py), and int8 activations per block of 32 (kernels/group_q8.py, held
    to its own arithmetic: quantization error is not measured here)."""
    if not tiled_gemm.available():
        return []
    packed = tiled_gemm.pack_group_weight(q, scales, mins, bits)
    cands = [Candidate(f"{fam}.kvslim_group", fam, nbytes,
                       lambda x: tiled_gemm.group_linear(x, packed), ref)]
    if group_q8.available() and group_q8.usable(q.shape[1], scales.shape[1]):
        q8 = group_q8.pack_q8_weight(q, scales, mins, bits)
        cands.append(Candidate(f"{fam}.kvslim_q8", fam, nbytes,
                               lambda x: group_q8.q8_linear(x, q8), lambda x: group_q8.
                               reference_group_linear_q8(x, q, scales, mins).float()))
    return cands


def int4_large_m_candidates(q, scales, zeros, group, w_deq) -> list[Candidate]:
    """Ways to run a 4-bit layer at many rows, probed against the native op (which scales
    poorly with M): a bfloat16 copy of the dequantized weight (4x the 4-bit bytes) through
    oneDNN's bf16 GEMM; and W8A8 per group, exact in the weight when zero points are integers
    (q - zero fits int8) but one torch._int_mm per group, because a per-group scale cannot be
    applied after a single integer product over all inputs."""
    fam = f"int4-g{group}"
    w_bf16 = w_deq.bfloat16()
    cands = [Candidate(f"{fam}.bf16_copy_mm", fam, w_bf16.numel() * 2,
                       lambda x: torch.mm(x.bfloat16(), w_bf16.t()).float(),
                       _bf16_input_ref(w_deq), rtol=BF16_RTOL)]
    if not hasattr(torch, "_int_mm"):
        return cands
    zero_int = torch.round(zeros)
    codes = (q.float().view(q.shape[0], -1, group) - zero_int[..., None]).to(torch.int8)
    blocks = [codes[:, k].t().contiguous() for k in range(codes.shape[1])]      # [group, out]
    scales_t = scales.t().contiguous()                                           # [groups, out]
    w_int = (codes.float() * scales[..., None]).reshape(q.shape)

    def grouped_int_mm(x):
        xq, sx = quantize_tokens(x)
        acc = torch.zeros(x.shape[0], q.shape[0])
        for k, block in enumerate(blocks):
            part = torch._int_mm(xq[:, k * group:(k + 1) * group].contiguous(), block)
            acc.addcmul_(part.float(), scales_t[k])
        return acc.mul_(sx)

    def ref(x):
        xq, sx = quantize_tokens(x)
        return F.linear(xq.float() * sx, w_int)
    cands.append(Candidate(f"{fam}.w8a8_per_group_int_mm", fam,
                           q.numel() + scales.numel() * 4, grouped_int_mm, ref, rtol=1e-4))
    return cands


def w8a8_candidates(w: torch.Tensor) -> list[Candidate]:
    q, s = quantize_int8(w)
    w_deq = q.float() * s[:, None]

    def ref(x):
        xq, sx = quantize_tokens(x)
        return F.linear(xq.float() * sx, w_deq)
    nbytes = q.numel() + s.numel() * 4
    q_t, q_in_out = q.t(), q.t().contiguous()

    def int_mm(weight_t):
        def fn(x):
            xq, sx = quantize_tokens(x)
            return torch._int_mm(xq, weight_t).float().mul_(sx).mul_(s)
        return fn

    def float_emulated(x):
        xq, sx = quantize_tokens(x)
        return F.linear(xq.float(), q.float()).mul_(sx).mul_(s)
    cands = [Candidate("w8a8.float_emulated", "w8a8", nbytes, float_emulated, ref, rtol=1e-3)]
    if hasattr(torch, "_int_mm"):
        cands += [Candidate("w8a8.int_mm", "w8a8", nbytes, int_mm(q_t), ref, rtol=1e-4),
                  Candidate("w8a8.int_mm_in_out", "w8a8", nbytes, int_mm(q_in_out), ref,
                            rtol=1e-4)]
    if group_q8.available() and group_q8.w8a8_usable(q.shape[1]):
        packed = group_q8.pack_w8a8_weight(q, s)
        cands.append(Candidate("w8a8.kvslim_q8", "w8a8", nbytes,
                               lambda x: group_q8.w8a8_mm(x, packed), ref, rtol=1e-4))
    return cands


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def torchao_candidates(w: torch.Tensor, groups: tuple[int, ...],
                       skipped: dict[str, str]) -> list[Candidate]:
    """Weight-only int8, int4 (its CPU packing) and dynamic W8A8 through torchao.quantize_,
    each held to the float weight (torchao picks its own scales). A config that fails is left
    out, with the reason in `skipped`."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.quantization as tq
    ref: Fn = lambda x: F.linear(x, w)                               # noqa: E731
    configs = [("int8", 0.02, w.numel(), lambda: tq.Int8WeightOnlyConfig()),
               ("w8a8", 0.05, w.numel(), lambda: tq.Int8DynamicActivationInt8WeightConfig())]
    configs += [(f"int4-g{g}", 0.2, w.numel() // 2 + w.numel() // g * 8,
                 lambda g=g: tq.Int4WeightOnlyConfig(group_size=g, int4_packing_format="opaque"))
                for g in groups]
    cands = []
    for fam, rtol, nbytes, make in configs:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tq.quantize_(lin, make())
                lin(torch.randn(1, w.shape[1]))
        except Exception as e:                                       # noqa: BLE001
            skipped[f"{fam}.torchao"] = f"{type(e).__name__}: {e}"[:300]
            continue
        cands.append(Candidate(f"{fam}.torchao", fam, nbytes, lin, ref, rtol=rtol))
    return cands


def build_candidates(w: torch.Tensor, groups: tuple[int, ...], compile_: bool,
                     torchao: bool, skipped: dict[str, str]) -> list[Candidate]:
    cands = fp32_candidates(w) + int8_candidates(w, compile_)
    fits = [g for g in groups if w.shape[1] % g == 0]
    skipped.update({f"int4-g{g}@{w.shape[1]}": f"{w.shape[1]} inputs are not a whole number of "
                    f"groups of {g}" for g in groups if g not in fits})
    for g in fits:
        cands += int4_candidates(w, g, compile_ and g == fits[0])
    cands += w8a8_candidates(w)
    for g in INT8_GROUPS:
        if w.shape[1] % g == 0:
            cands += int8_group_candidates(w, g)
    if torchao and torchao_available():
        cands += torchao_candidates(w, tuple(fits), skipped)
    return cands
