"""The arithmetic of the 4- and 2-bit KV cache (`--kv-cache-dtype int4` / `int2`), in plain
torch: how a full block of keys and values becomes codes and parameters, and back.

KIVI (arXiv 2402.02750): keys have outlier *channels*, so a key is quantized per channel over
the block's tokens (one scale and minimum per block, KV head and channel); values are quantized
per token in groups of `VALUE_GROUP` channels. Both are asymmetric: code = round((x - min) /
scale) in [0, 2^bits - 1], x ~ code * scale + min. Scale and minimum are float16 and the codes are
computed from the float16-rounded ones, so dequantizing is exact arithmetic on what is stored.
Codes are packed along head_dim in planes, as llama.cpp's Q4_0 packs its nibbles: with n =
D * bits / 8 bytes a row, element d lies in bits (d // n) * bits of byte d % n, so the kernel
(kernels/csrc/paged_attention.cpp) unpacks a row as per_byte contiguous runs, a shift and a mask
each, which vectorize (interleaved codes did not: benchmarks/kv_lowbit_attention.py).

Measured before building (benchmarks/kv_lowbit_probe.py, docs/kv-cache-compression.md): per
channel keys lose 1.3% perplexity at 4 bits on SmolLM2, per token keys 16%."""
from __future__ import annotations

import math

import torch

from kvslim.dtypes import KV_SCALE_DTYPE

VALUE_GROUP = 64          # channels per value scale (a head narrower than this: the whole head)
_MIN_SCALE = 2.0 ** -14   # float16's smallest normal: a constant run gets this, not 0


def value_group(head_dim: int) -> int:
    return min(VALUE_GROUP, head_dim)


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes of one packed row."""
    return head_dim * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2^bits) -> uint8 [..., D * bits / 8]."""
    per_byte = 8 // bits
    planes = codes.view(*codes.shape[:-1], per_byte, -1).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32)[:, None] * bits
    return (planes << shifts).sum(-2).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack`: uint8 codes [..., D]."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32)[:, None] * bits
    codes = (packed.to(torch.int32)[..., None, :] >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2).to(torch.uint8)


def _asymmetric(x: torch.Tensor, bits: int, dim: int):
    """x float -> (codes uint8, params float16 [..., 2, ...] = (scale, min) along `dim`)."""
    top = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / top).clamp(min=_MIN_SCALE).to(KV_SCALE_DTYPE)
    lo = lo.to(KV_SCALE_DTYPE)
    codes = ((x - lo.float()) / scale.float()).round().clamp(0, top).to(torch.uint8)
    return codes, scale, lo


def quantize_key_blocks(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full blocks of keys [n, block_size, kvh, D] -> (packed [n, block_size, kvh, D*bits/8],
    params float16 [n, kvh, 2, D]): one scale and minimum per block, head and channel."""
    codes, scale, lo = _asymmetric(x.float(), bits, dim=1)          # [n, 1, kvh, D]
    params = torch.stack([scale[:, 0], lo[:, 0]], dim=2)            # [n, kvh, 2, D]
    return pack(codes, bits), params


def quantize_value_blocks(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [n, block_size, kvh, D] -> (packed, params float16 [n, block_size, kvh, 2, D/g])."""
    d = x.shape[-1]
    g = value_group(d)
    groups = x.float().reshape(*x.shape[:-1], d // g, g)
    codes, scale, lo = _asymmetric(groups, bits, dim=-1)           # [.., D/g, 1]
    params = torch.stack([scale[..., 0], lo[..., 0]], dim=-2)      # [.., 2, D/g]
    return pack(codes.reshape(x.shape), bits), params


def dequantize_keys(packed: torch.Tensor, params: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, block_size, kvh, D*bits/8] and [n, kvh, 2, D] -> float32 [n, block_size, kvh, D]."""
    codes = unpack(packed, bits).float()
    return codes * params[:, None, :, 0].float() + params[:, None, :, 1].float()


def dequantize_values(packed: torch.Tensor, params: torch.Tensor, bits: int) -> torch.Tensor:
    """[.., D*bits/8] and [.., 2, D/g] -> float32 [.., D]."""
    codes = unpack(packed, bits).float()
    d = codes.shape[-1]
    g = d // params.shape[-1]
    scale = params[..., 0, :].float().repeat_interleave(g, -1)
    lo = params[..., 1, :].float().repeat_interleave(g, -1)
    return codes * scale + lo


def hadamard(n: int, device: torch.device | None = None) -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix of order n (a power of two): orthogonal, so
    q . k and the weighted sum of values survive the rotation exactly (QuaRot); rotating K and V
    before quantizing spreads outlier channels over all of them."""
    if n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device)


def block_bytes(kv_heads: int, head_dim: int, bits: int, block_size: int) -> int:
    """One layer's block in the pool: K and V codes, the keys' scale and minimum per channel,
    the values' per token and group (float16 each)."""
    codes = 2 * block_size * kv_heads * packed_width(head_dim, bits)
    key_params = kv_heads * 2 * head_dim * 2
    value_params = block_size * kv_heads * 2 * (head_dim // value_group(head_dim)) * 2
    return codes + key_params + value_params


# KIVI's full-precision residual, in blocks (attention/lowbit_cache.py): a query reads the
# block being filled and, at 2 bits, the full block before it from float16 recent rows.
RESIDUAL_BLOCKS = {4: 1, 2: 2}


def recent_blocks(bits: int, speculative: bool) -> int:
    """Blocks of recent rows a sequence keeps: its residual, and with speculative decoding one
    more (a step may fill a block and give tokens back)."""
    return RESIDUAL_BLOCKS[bits] + int(speculative)
