"""Attention over the paged KV cache, for one engine step.

Tokens of the step are flat: first the decodes (one token each), then the prefill chunks. Every
new token's K/V is written into the cache through `slot_mapping` (each layer's `KVCacheLayer`,
in the model's dtype or quantized, see `kv_cache.py`); decodes then read their whole
context through the block tables in one batched call, and each prefill chunk attends to its
cached prefix plus itself (prefix caching and chunked prefill both rely on that). What to attend
to (masks, the lone-decode case) comes ready-made in the step's metadata (see `metadata.py`)."""
from __future__ import annotations

import torch

from kvslim.attention.grouped import MaskCache, grouped_sdpa
from kvslim.attention.kv_cache import KVCacheLayer
from kvslim.attention.metadata import PagedAttentionMetadata
from kvslim.kernels import paged_attention


class PagedAttention:
    def __init__(self, kv_caches: list[KVCacheLayer],
                 meta: PagedAttentionMetadata | list[PagedAttentionMetadata],
                 decode_kernel: bool = False):
        """meta: the step's metadata, or one per layer (`build_layer_metadata`: layers with
        different sliding windows read different masks over the same layout). decode_kernel:
        decodes through kvslim's C++ kernel, reading the cache in place (backends.py)."""
        self.kv_caches = kv_caches
        self.decode_kernel = decode_kernel
        self.layer_metas = meta if isinstance(meta, list) else [meta] * len(kv_caches)
        self.mask_caches = {id(m): MaskCache() for m in self.layer_metas}

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [N, H, D]; k, v [N, KVH, D] for the step's new tokens. Returns [N, H, D]."""
        meta = self.layer_metas[layer_idx]
        masks = self.mask_caches[id(meta)]
        cache = self.kv_caches[layer_idx]
        k, v = cache.write(meta.layout.slot_mapping, k, v)
        nd = meta.layout.num_decode_tokens
        decoded = None
        if nd and self.decode_kernel:
            decoded = self._decode_in_place(meta, cache, q[:nd], scale)
        elif nd:
            decoded = self._attend_decodes(meta, masks, cache, q[:nd], scale)
            if not meta.layout.prefills:          # a pure decode step: no copy into out
                return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:nd] = decoded
        self._attend_prefills(meta, masks, cache, q, k, v, scale, out)
        return out

    @staticmethod
    def _attend_decodes(meta: PagedAttentionMetadata, masks: MaskCache, cache: KVCacheLayer,
                        q: torch.Tensor, scale: float) -> torch.Tensor:
        """All decodes in one batched call over their block tables. q [num_decodes, H, D]."""
        nd = q.shape[0]
        keys, values = cache.gather(meta.layout.decode_block_tables.reshape(-1))
        kvh, d = keys.shape[1], keys.shape[2]
        keys, values = keys.view(nd, -1, kvh, d), values.view(nd, -1, kvh, d)
        mask = masks.get(-1, meta.decode_allowed, q.shape[1] // kvh, q.dtype)
        return grouped_sdpa(q[:, None], keys, values, mask, scale)[:, 0]

    @staticmethod
    def _decode_in_place(meta: PagedAttentionMetadata, cache: KVCacheLayer, q: torch.Tensor,
                         scale: float) -> torch.Tensor:
        layout = meta.layout
        return paged_attention.paged_decode(
            q, cache.k_cache, cache.v_cache, getattr(cache, "k_scales", None),
            getattr(cache, "v_scales", None), layout.decode_block_tables,
            layout.decode_context_lens, layout.decode_key_start, meta.sliding_window, scale)

    @staticmethod
    def _attend_prefills(meta: PagedAttentionMetadata, masks: MaskCache, cache: KVCacheLayer,
                         q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         out: torch.Tensor) -> None:
        """Each chunk attends to its cached prefix plus itself; results go into `out`. k, v are
        the step's new K/V as `cache.write` returned them."""
        group = q.shape[1] // k.shape[1]
        chunks = zip(meta.layout.prefills, meta.prefill_allowed)
        for i, (chunk, allowed) in enumerate(chunks):
            s, t = chunk.query_start, chunk.query_len
            if chunk.context_len == t:          # nothing cached before: use the fresh K/V
                keys, values = k[s:s + t], v[s:s + t]
            else:
                keys, values = cache.gather(chunk.block_table)
                n = chunk.context_len - chunk.key_start
                keys, values = keys[:n], values[:n]
            mask = masks.get(i, allowed, group, q.dtype)
            out[s:s + t] = grouped_sdpa(q[None, s:s + t], keys[None], values[None], mask, scale)[0]
