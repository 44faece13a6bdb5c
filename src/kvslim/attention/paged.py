"""Attention over the paged KV cache, for one engine step.

Tokens of the step are flat: first the decodes (one token each), then the prefill chunks. Every
new token's K/V is written into the cache through `slot_mapping`; decodes then read their whole
context through the block tables in one batched call, and each prefill chunk attends to its
cached prefix plus itself (prefix caching and chunked prefill both rely on that)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvslim.attention.grouped import MaskCache, causal_mask, grouped_sdpa


@dataclass
class PrefillChunk:
    query_start: int          # offset of the chunk in the step's flat tokens
    query_len: int            # tokens computed this step
    context_len: int          # cached prefix + query_len
    block_table: torch.Tensor  # [num_blocks] block ids covering the context


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor                 # [num_tokens] cache slot of each new token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    prefills: list[PrefillChunk] = field(default_factory=list)


class PagedAttention:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: PagedAttentionMetadata, sliding_window: int | None = None,
                 graph_safe: bool = False):
        """graph_safe: no host synchronisation (the decode path a CUDA graph records)."""
        self.kv_caches = kv_caches
        self.meta = meta
        self.block_size = kv_caches[0][0].shape[1]
        device = meta.slot_mapping.device
        self.masks = MaskCache()
        self.decode_allowed = None
        # A lone decode (batch-1 generation) reads exactly its context: no mask, and SDPA's
        # unmasked path, instead of masking the padding of its last block.
        self.single_decode_len = (int(meta.decode_context_lens[0])
                                  if meta.num_decode_tokens == 1 and sliding_window is None
                                  and not graph_safe else None)
        if meta.num_decode_tokens and self.single_decode_len is None:
            max_len = meta.decode_block_tables.shape[1] * self.block_size
            key_pos = torch.arange(max_len, device=device)[None, :]
            lens = meta.decode_context_lens[:, None]
            allowed = key_pos < lens
            if sliding_window is not None:
                allowed &= key_pos >= lens - sliding_window
            self.decode_allowed = allowed[:, None, :]       # [B, Tq=1, Tk]
        self.prefill_allowed = [
            None if (p.query_len == p.context_len and sliding_window is None)
            else causal_mask(p.query_len, p.context_len, device, sliding_window)[None]
            for p in meta.prefills]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [N, H, D]; k, v [N, KVH, D] for the step's new tokens. Returns [N, H, D]."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        slots = self.meta.slot_mapping
        k_cache.view(-1, kvh, d)[slots] = k
        v_cache.view(-1, kvh, d)[slots] = v
        group = q.shape[1] // kvh
        nd = self.meta.num_decode_tokens
        decoded = None
        if nd:
            # index_select copies whole blocks (memcpy); advanced indexing is 4x slower here.
            blocks = self.meta.decode_block_tables.reshape(-1)
            keys = k_cache.index_select(0, blocks).view(nd, -1, kvh, d)
            values = v_cache.index_select(0, blocks).view(nd, -1, kvh, d)
            if self.single_decode_len is not None:
                n = self.single_decode_len
                decoded = grouped_sdpa(q[:1, None], keys[:, :n], values[:, :n], None, scale,
                                       causal=False)[:, 0]
            else:
                mask = self.masks.get(-1, self.decode_allowed, group, q.dtype)
                decoded = grouped_sdpa(q[:nd, None], keys, values, mask, scale)[:, 0]
            if not self.meta.prefills:                 # a pure decode step: no copy into out
                return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:nd] = decoded
        for i, (chunk, allowed) in enumerate(zip(self.meta.prefills, self.prefill_allowed)):
            s, t = chunk.query_start, chunk.query_len
            if chunk.context_len == t:          # nothing cached before: use the fresh K/V
                keys, values = k[s:s + t], v[s:s + t]
            else:
                keys = k_cache.index_select(0, chunk.block_table).view(-1, kvh, d)
                values = v_cache.index_select(0, chunk.block_table).view(-1, kvh, d)
                keys, values = keys[:chunk.context_len], values[:chunk.context_len]
            mask = self.masks.get(i, allowed, group, q.dtype)
            out[s:s + t] = grouped_sdpa(q[None, s:s + t], keys[None], values[None], mask, scale)[0]
        return out
