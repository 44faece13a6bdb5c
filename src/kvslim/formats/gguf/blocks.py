"""Decode llama.cpp's quantized blocks into the one form kvslim keeps them in
(quantization/gguf_blocks.py): per weight an unsigned integer q (uint8), per group of 16 inputs a
float32 scale s and offset m, with w = q * s + m computed in float32, bit for bit what
`gguf.quants.dequantize` (and llama.cpp's dequantize_row_*) gives:

    type  block (inputs, bytes)          llama.cpp            q      s        m
    Q4_0  32, fp16 d + 16 nibbles        d * (q - 8)          0..15  d        -8 d
    Q4_1  32, fp16 d, m + 16 nibbles     d * q + m            0..15  d        m
    Q5_0  32, fp16 d, 4 bytes of high bits + 16 nibbles
                                         d * (q - 16)         0..31  d        -16 d
    Q8_0  32, fp16 d + 32 int8           d * q                q+128  d        -128 d
    Q4_K  256, fp16 d, dmin, 12 bytes of 6-bit (sc, mn) for 8 sub-blocks of 32, 128 nibbles
                                         d*sc * q - dmin*mn   0..15  d*sc     -(dmin*mn)
    Q6_K  256, 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 sc, fp16 d (last)
                                         d*sc * (q - 32)      0..63  d*sc     -32 d*sc

Why exact: d is fp16 (11 significant bits) and sc/mn at most 8 bits, so d*sc and dmin*mn are
exact in float32; q * s then needs at most 24 significant bits (Q8_0: 11 + 8, Q6_K: 18 + 6),
so it is exact too, and q * s + m is either the reference's own expression or, where the
reference subtracts the offset inside the product (Q4_0, Q5_0, Q8_0, Q6_K), its exact value.

Every type is stored at groups of 16 (Q6_K's sub-block); the others repeat each scale and
offset over their group of 32. `BITS` says which kernel form a type takes."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

# The kept types' ids, widths and zeros are the layer's (the layer reads `qtype` by them).
from kvslim.quantization.gguf_blocks import BITS, GROUP, TYPE_IDS, ZERO  # noqa: F401

QK_K = 256
BLOCK_SIZES = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": QK_K, "Q6_K": QK_K}


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per entry along the last axis -> float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles are values 0-15, high nibbles 16-31."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _q4_0(raw):
    d = _f16(raw[..., 0:2])
    return _nibbles(raw[..., 2:]), d, -8 * d


def _q4_1(raw):
    return _nibbles(raw[..., 4:]), _f16(raw[..., 0:2]), _f16(raw[..., 2:4])


def _q5_0(raw):
    """Value j's fifth bit is bit j of the 4 bytes after d (little endian), above its nibble."""
    d = _f16(raw[..., 0:2])
    high = np.unpackbits(raw[..., 2:6], axis=-1, bitorder="little")
    return _nibbles(raw[..., 6:]) | (high << 4), d, -16 * d


def _q8_0(raw):
    d = _f16(raw[..., 0:2])
    q = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _q4_k(raw):
    """Sub-blocks of 32: the 128 bytes of nibbles are 4 runs of 32 bytes, each holding sub-block
    2j in its low nibbles and 2j+1 in its high ones."""
    d, dmin = _f16(raw[..., 0:2])[..., None], _f16(raw[..., 2:4])[..., None]
    s = raw[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((lo & 63, (hi & 15) | ((lo >> 2) & 48)), axis=-1).astype(np.float32)
    mn = np.concatenate((mid & 63, (hi >> 4) | ((mid >> 2) & 48)), axis=-1).astype(np.float32)
    qs = raw[..., 16:].reshape(*raw.shape[:-1], 4, 32)
    q = np.stack((qs & 15, qs >> 4), axis=-2).reshape(*raw.shape[:-1], 8, 32)
    return q, d * sc, -(dmin * mn)


def _q6_k(raw):
    """Two halves of 128 values; in half h, value 32k + l (k < 4) takes its low 4 bits from
    ql[64h + l + 32(k & 1)] (low nibble for k < 2, high for k >= 2) and its top 2 bits from
    qh[32h + l] >> 2k."""
    lead = raw.shape[:-1]
    ql = raw[..., 0:128].reshape(*lead, 2, 1, 64)
    qh = raw[..., 128:192].reshape(*lead, 2, 1, 32)
    sc = raw[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(raw[..., 208:210])[..., None]
    low = (ql >> np.array([0, 4], dtype=np.uint8)[:, None]) & 15        # [.., 2, 2, 64]
    low = low.reshape(*lead, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [.., 2, 4, 32]
    q = (low | (high << 4)).reshape(*lead, 16, 16)
    s = d * sc
    return q, s, -32 * s


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q6_K": _q6_k}
_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}


def decode_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """Raw bytes of a [rows, cols] tensor of type `kind` -> qvalues uint8 [rows, cols], scales
    and mins float32 [rows, cols / 16]."""
    size = BLOCK_SIZES[kind]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // size, _BYTES[kind])
    q, s, m = _DECODERS[kind](blocks)
    s, m = s.reshape(rows, -1), m.reshape(rows, -1)       # one per block or sub-block
    span = cols // GROUP // s.shape[1]                    # groups of 16 under one scale
    s, m = np.repeat(s, span, axis=1), np.repeat(m, span, axis=1)
    return {"qvalues": torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols))),
            "scales": torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)),
            "mins": torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32))}


def tensor_blocks(tensor: Any) -> dict[str, torch.Tensor]:
    """A GGUF tensor (gguf.ReaderTensor) of a kept type, decoded, plus its type id."""
    kind = tensor.tensor_type.name
    rows, cols = (int(d) for d in reversed(tensor.shape))
    out = decode_blocks(tensor.data, kind, rows, cols)
    out["qtype"] = torch.tensor([TYPE_IDS[kind]], dtype=torch.int32)
    return out


def kept_type(kind: str, cols: int) -> bool:
    return kind in TYPE_IDS and cols % BLOCK_SIZES[kind] == 0
