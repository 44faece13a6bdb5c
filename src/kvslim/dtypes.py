"""Every dtype name kvslim takes, written once: a model's float dtypes, the KV cache's quantized
ones and the memory planner's storage widths, each with its one spelling, its aliases, its bits
and its torch dtype. Flags, configs and the planner all read this table."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.errors import ConfigError


@dataclass(frozen=True)
class DType:
    name: str                          # the spelling kvslim writes (config.json, --kv-cache-dtype)
    short: str                         # the memory planner's column name
    bits: int                          # per stored element (int4 packs two a byte)
    torch_dtype: torch.dtype | None    # None: a storage width only (the planner's int4)
    aliases: tuple[str, ...] = ()
    model: bool = False                # a dtype a model computes in
    kv_quantized: bool = False         # a KV cache stored with a float16 scale per token and head
    kv_packed: bool = False            # a KV cache of packed codes, KIVI's layout (lowbit_codes)


DTYPES: tuple[DType, ...] = (
    DType("float32", "fp32", 32, torch.float32, ("float", "f32"), model=True),
    DType("float16", "fp16", 16, torch.float16, ("half", "f16"), model=True),
    DType("bfloat16", "bf16", 16, torch.bfloat16, model=True),
    DType("fp8_e4m3", "fp8", 8, torch.float8_e4m3fn, ("float8", "float8_e4m3fn", "float8_e5m2"),
          kv_quantized=True),
    DType("int8", "int8", 8, torch.int8, kv_quantized=True),
    DType("int4", "int4", 4, None, kv_packed=True),
    DType("int2", "int2", 2, None, kv_packed=True),
)
_BY_NAME = {key: d for d in DTYPES for key in (d.name, d.short, *d.aliases)}

MODEL_DTYPES = tuple(d.name for d in DTYPES if d.model)
# The quantized KV-cache dtypes the engine offers, by name.
QUANTIZED_KV_DTYPES = {d.name: d.torch_dtype for d in DTYPES if d.kv_quantized}
# The 4- and 2-bit KV caches (kernels/lowbit_codes.py), by name: their bits per code.
PACKED_KV_BITS = {d.name: d.bits for d in DTYPES if d.kv_packed}
# What `kv_cache_dtype` (`--kv-cache-dtype`) accepts: "auto" (the model's dtype) or one of those.
KV_CACHE_DTYPES = ("auto", *QUANTIZED_KV_DTYPES, *PACKED_KV_BITS)
KV_SCALE_DTYPE = torch.float16


def lookup(name: str | torch.dtype) -> DType | None:
    """The entry a name, alias or torch dtype names (case-insensitive); None if none does."""
    key = str(name).lower().removeprefix("torch.")
    return _BY_NAME.get(key)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A model's float dtype by any of its names."""
    if isinstance(name, torch.dtype):
        return name
    entry = lookup(name)
    if entry is None or not entry.model:
        raise ConfigError(f"unknown dtype {name!r}; choose one of float32, bfloat16, float16")
    return entry.torch_dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype, as config.json writes it ("float32", "float8_e4m3fn")."""
    return str(dtype).removeprefix("torch.")


def is_quantized_kv(dtype: torch.dtype | str) -> bool:
    """An int8/fp8 cache: elements with a float16 scale per token and head."""
    return dtype in QUANTIZED_KV_DTYPES.values()


def packed_kv_bits(kv_dtype: torch.dtype | str) -> int | None:
    """The bits of a packed 4-/2-bit cache's codes ("int4", "int2"), None for any other."""
    return PACKED_KV_BITS.get(kv_dtype) if isinstance(kv_dtype, str) else None
