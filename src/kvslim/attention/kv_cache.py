"""One layer's view of the paged KV cache: where a step's new K/V are written and where attention
reads them back, in the model's dtype or quantized (`--kv-cache-dtype int8` / `fp8_e4m3`).

`PagedAttention` calls only `write` (new tokens, through the slot mapping) and `gather` (whole
blocks, through a block table), so the quantized cache is one more class behind those two calls,
chosen once when the engine allocates its cache.

Quantized K/V are symmetric with one scale per token and KV head (absmax over head_dim / qmax),
kept in a separate `scales` tensor [blocks, block_size, kv_heads] beside the int8/fp8 elements.
Scales are float16: 2 bytes per head_dim elements (3.1% at head_dim 64, against 6.2% for float32),
and their relative rounding (2^-11) is far below one int8 step (1/127 of the absmax). Elements are
quantized with the float16-rounded scale itself, so dequantizing is exact arithmetic on what is
stored.

A step's fresh tokens are attended as they will be read back later (`write` returns the
dequantized values), never in full precision: a prompt computed in one chunk, in several, or
found in the prefix cache then sees bit-identical keys and values, so greedy output does not
depend on chunking, batch composition or prefix-cache hits."""
from __future__ import annotations

import torch

from kvslim.dtypes import (KV_CACHE_DTYPES, KV_SCALE_DTYPE, QUANTIZED_KV_DTYPES,  # noqa: F401
                           packed_kv_bits)
from kvslim.errors import KvslimError
from kvslim.kernels import store_slots as slot_kernel

# float16's smallest normal number: a row of zeros gets this scale instead of a division by 0.
_MIN_SCALE = 2.0 ** -14


class KVCacheLayer:
    """K and V of one layer in the model's dtype: [blocks, block_size, kv_heads, head_dim] each."""
    latent = False          # MLA's latent rows instead of K/V heads (latent_cache.py)
    packed = False          # 4-/2-bit codes with recent rows beside them (lowbit_cache.py)

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 demoted_scales: torch.Tensor | None = None):
        """demoted_scales: under `--kv-pressure demote` (engine/kv_demotion.py), the float16
        scales [2, 4 * blocks, block_size, kv_heads] of the int8 blocks demoted into this
        float32 cache's bytes (kernels/paged_attention.py's `demoted_view`), read by the
        kernel only."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.demoted_scales = demoted_scales
        self.store = slot_writer(k_cache)

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store the new tokens' k, v [N, KVH, D] at `slots`; returns the K/V attention should
        use for them (what `gather` will give back)."""
        self.store(self.k_cache, slots, k)
        self.store(self.v_cache, slots, v)
        return k, v

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks`, [len(blocks) * block_size, KVH, D]."""
        kvh, d = self.k_cache.shape[2], self.k_cache.shape[3]
        # index_select copies whole blocks (memcpy); advanced indexing is 4x slower here.
        return (self.k_cache.index_select(0, blocks).view(-1, kvh, d),
                self.v_cache.index_select(0, blocks).view(-1, kvh, d))


class QuantizedKVCacheLayer(KVCacheLayer):
    """int8 or fp8 K/V plus float16 scales [blocks, block_size, kv_heads] for each; attention
    computes in `dtype` (the model's)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor,
                 v_scales: torch.Tensor, dtype: torch.dtype):
        super().__init__(k_cache, v_cache)
        self.k_scales, self.v_scales, self.dtype = k_scales, v_scales, dtype

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        fresh = []
        for x, cache, scales in ((k, self.k_cache, self.k_scales),
                                 (v, self.v_cache, self.v_scales)):
            q, s = quantize(x, cache.dtype)
            self.store(cache, slots, q)
            self.store(scales, slots, s)
            fresh.append(dequantize(q, s, self.dtype))
        return fresh[0], fresh[1]

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kvh, d = self.k_cache.shape[2], self.k_cache.shape[3]
        return tuple(dequantize(cache.index_select(0, blocks).view(-1, kvh, d),
                                scales.index_select(0, blocks).view(-1, kvh), self.dtype)
                     for cache, scales in ((self.k_cache, self.k_scales),
                                           (self.v_cache, self.v_scales)))


def slot_writer(cache: torch.Tensor):
    """How a cache on `cache`'s device takes its new tokens: the extension's write on the CPU
    (one C++ call; `store_slots` costs a Python custom op's dispatch inside a compiled step and
    an index_put outside), else `store_slots`."""
    if cache.device.type == "cpu" and slot_kernel.available():
        return torch.ops.kvslim.write_slots
    return store_slots


def store_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache [blocks, block_size, ...] at flat slot indices `slots` = values [len(slots), ...].
    Inside a compiled decode step (engine/cpu_compile.py) a custom op that mutates the cache in
    place: written as indexing, the compiler's functional form of the mutation copied the whole
    cache back every step (measured: 250 ms of a 360 ms SmolLM2 step with a 1 GiB cache)."""
    if torch.compiler.is_compiling():
        _store_slots(cache, slots, values)
    else:
        cache.view(-1, *cache.shape[2:])[slots] = values


@torch.library.custom_op("kvslim::store_slots", mutates_args=("cache",))
def _store_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    cache.view(-1, *cache.shape[2:])[slots] = values


@_store_slots.register_fake
def _(cache, slots, values) -> None:
    return None


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (elements [..., D] in `dtype`, float16 scales [...]), symmetric per row."""
    qmax = float(torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max)
    amax = x.abs().amax(dim=-1).float()
    scale = (amax / qmax).clamp(min=_MIN_SCALE).to(KV_SCALE_DTYPE)
    y = (x.float() / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round()
    return y.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype).unsqueeze(-1)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """"auto" is the model's dtype; "int8" anywhere; "fp8_e4m3" where this device and torch can
    store, index and convert float8 (checked by doing it, not by a version table); "int4" and
    "int2" stay names (packed codes, lowbit_cache.py)."""
    if name == "auto":
        return model_dtype
    if packed_kv_bits(name):
        return name
    dtype = QUANTIZED_KV_DTYPES[name]
    if dtype.is_floating_point:
        _check_float8(name, dtype, device)
    return dtype


def _check_float8(name: str, dtype: torch.dtype, device: torch.device) -> None:
    try:
        x = torch.linspace(-2, 2, 16, device=device).view(2, 8)
        cache = torch.zeros(4, 8, dtype=dtype, device=device)
        cache[torch.tensor([1, 3], device=device)] = x.to(dtype)
        back = cache.index_select(0, torch.tensor([3], device=device)).float()
        ok = bool(torch.allclose(back, x[1:], atol=0.13))
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise KvslimError(f"kv_cache_dtype={name} is not supported on {device} by torch "
                          f"{torch.__version__} ({e}); use int8") from None
    if not ok:
        raise KvslimError(f"kv_cache_dtype={name}: its round trip is wrong on {device} "
                          f"with torch {torch.__version__}; use int8")
