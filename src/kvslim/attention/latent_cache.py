"""One layer's latent KV cache: DeepSeek's multi-head latent attention (MLA) stores one row per
token, [c_kv; k_rope] (kv_lora_rank + qk_rope_head_dim), and no heads.

With the up-projection absorbed into the query and the output (layers/latent_attention.py), MLA
is multi-query attention with one KV head whose key is that row and whose value is the row's
first kv_lora_rank entries (c_kv). So the cache stores the key once and hands out the value as a
view of it: `write` and `gather` give (key, key[..., :value_width]), as `KVCacheLayer`'s give
(K, V), and `PagedAttention`'s gather path runs over it unchanged (SDPA takes a value narrower
than the key). Storage: [blocks, block_size, 1, width] per layer.

Quantized (int8 / fp8_e4m3): one float16 scale per token and layer, over the whole row (what
`ModelConfig.kv_scales_per_token` prices for MLA), in [blocks, block_size, 1]; as the quantized
head caches do, a step's fresh tokens are attended as they are read back later."""
from __future__ import annotations

import torch

from kvslim.attention.kv_cache import KVCacheLayer, dequantize, quantize, slot_writer


class LatentKVCacheLayer(KVCacheLayer):
    """The latent rows of one layer in the model's dtype; `v_cache` is a view of `k_cache`."""
    latent = True

    def __init__(self, cache: torch.Tensor, value_width: int):
        """cache [blocks, block_size, 1, width]; value_width: kv_lora_rank."""
        self.k_cache, self.v_cache = cache, cache[..., :value_width]
        self.value_width = value_width
        self.store = slot_writer(cache)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None):
        """Store the new tokens' rows k [N, 1, width] at `slots` (v, the first value_width
        entries of k, is not stored); returns (key, value) as `gather` will give them back."""
        self.store(self.k_cache, slots, k)
        return k, k[..., :self.value_width]

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of `blocks` [len(blocks) * block_size, 1, width] and their value view."""
        keys = self.k_cache.index_select(0, blocks).view(-1, 1, self.k_cache.shape[-1])
        return keys, keys[..., :self.value_width]


class QuantizedLatentKVCacheLayer(LatentKVCacheLayer):
    """int8 or fp8 rows plus a float16 scale per row [blocks, block_size, 1]; attention
    computes in `dtype` (the model's)."""

    def __init__(self, cache: torch.Tensor, scales: torch.Tensor, value_width: int,
                 dtype: torch.dtype):
        super().__init__(cache, value_width)
        # the value is a view of the key: one scale per row serves both
        self.k_scales, self.v_scales, self.dtype = scales, scales, dtype

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None):
        q, s = quantize(k, self.k_cache.dtype)
        self.store(self.k_cache, slots, q)
        self.store(self.k_scales, slots, s)
        k = dequantize(q, s, self.dtype)
        return k, k[..., :self.value_width]

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.k_cache.shape[-1]
        keys = dequantize(self.k_cache.index_select(0, blocks).view(-1, 1, width),
                          self.k_scales.index_select(0, blocks).view(-1, 1), self.dtype)
        return keys, keys[..., :self.value_width]


def latent_cache_layers(tensors: list[torch.Tensor], scales: list[torch.Tensor] | None,
                        value_width: int, dtype: torch.dtype) -> list[LatentKVCacheLayer]:
    """The layers over the runner's tensors [1, blocks, block_size, 1, width] (and, for a
    quantized cache, its scales [1, blocks, block_size, 1])."""
    if scales is None:
        return [LatentKVCacheLayer(t[0], value_width) for t in tensors]
    return [QuantizedLatentKVCacheLayer(t[0], s[0], value_width, dtype)
            for t, s in zip(tensors, scales)]
