"""Attention over the paged KV cache, for one engine step.

Tokens of the step are flat: first the decodes (one token each), then the prefill chunks. Every
new token's K/V is written into the cache through `slot_mapping` (each layer's `KVCacheLayer`,
in the model's dtype or quantized, see `kv_cache.py`); decodes then read their whole
context through the block tables in one batched call, and each prefill chunk attends to its
cached prefix plus itself (prefix caching and chunked prefill both rely on that). What to attend
to (masks, the lone-decode case) comes ready-made in the step's metadata (see `metadata.py`).
With `kernel` (the CPU's default backend) every token instead goes through kvslim's kernel,
reading the cache in place over the keys before its own position."""
from __future__ import annotations

import torch

from kvslim.attention.grouped import MaskCache, grouped_sdpa
from kvslim.attention.kv_cache import KVCacheLayer
from kvslim.attention.metadata import PagedAttentionMetadata, PagedStepLayout
from kvslim.kernels import paged_attention


class PagedAttention:
    def __init__(self, kv_caches: list[KVCacheLayer],
                 meta: PagedAttentionMetadata | list[PagedAttentionMetadata],
                 kernel: bool = False):
        """meta: the step's metadata, or one per layer (`build_layer_metadata`: layers with
        different sliding windows read different masks over the same layout). kernel: every
        token through kvslim's C++ kernel, reading the cache in place (backends.py)."""
        self.kv_caches = kv_caches
        self.kernel = kernel
        self.layer_metas = meta if isinstance(meta, list) else [meta] * len(kv_caches)
        self.mask_caches = {id(m): MaskCache() for m in self.layer_metas}
        self.kernel_rows: dict[int, tuple] = {}      # per metadata: `_rows_of_tokens`'s

    def caches_latent(self, layer_idx: int) -> bool:
        """Whether the layer's cache holds MLA's latent rows (latent_cache.py): the layer then
        attends with one KV head, its key the row, its value the row's first entries."""
        return self.kv_caches[layer_idx].latent

    def native_inputs(self, layer_idx: int) -> tuple | None:
        """What kernels/decoder_layer.py's native layer needs of this step to do the layer's
        cache writes and attention itself: the kernel path over a float32 cache, no tree. None
        where the layer must run its modules."""
        cache = self.kv_caches[layer_idx]
        meta = self.layer_metas[layer_idx]
        if (not self.kernel or type(cache) is not KVCacheLayer
                or cache.k_cache.dtype != torch.float32 or meta.sink_tokens):
            return None
        key = id(meta)
        if key not in self.kernel_rows:
            self.kernel_rows[key] = _rows_of_tokens(meta.layout, cache.block_size)
        tables, lens, key_start, tree_base, _ = self.kernel_rows[key]
        if tree_base is not None:
            return None
        return (cache.k_cache, cache.v_cache, meta.layout.slot_mapping, tables, lens, key_start,
                meta.sliding_window or 0, cache.demoted_scales)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [N, H, D]; k, v [N, KVH, D] for the step's new tokens (a latent cache: v is a view
        of k's first Dv entries). Returns [N, H, Dv]."""
        meta = self.layer_metas[layer_idx]
        masks = self.mask_caches[id(meta)]
        cache = self.kv_caches[layer_idx]
        if cache.packed:
            return self._attend_packed(meta, cache, q, k, v, scale)
        k, v = cache.write(meta.layout.slot_mapping, k, v)
        if self.kernel:
            return self._attend_in_place(meta, cache, q, scale)
        nd = meta.layout.num_decode_tokens
        decoded = None
        if nd:
            decoded = self._attend_decodes(meta, masks, cache, q[:nd], scale)
            if not meta.layout.prefills:          # a pure decode step: no copy into out
                return decoded
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
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
        kvh = keys.shape[1]
        keys, values = keys.view(nd, -1, *keys.shape[1:]), values.view(nd, -1, *values.shape[1:])
        mask = masks.get(-1, meta.decode_allowed, q.shape[1] // kvh, q.dtype)
        return grouped_sdpa(q[:, None], keys, values, mask, scale)[:, 0]

    def _rows(self, meta: PagedAttentionMetadata, block_size: int) -> tuple:
        key = id(meta)
        if key not in self.kernel_rows:
            self.kernel_rows[key] = _rows_of_tokens(meta.layout, block_size)
        return self.kernel_rows[key]

    def _attend_packed(self, meta: PagedAttentionMetadata, cache, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """A 4-/2-bit cache (lowbit_cache.py): every token through the low-bit kernel, the pool
        before its own block and its block's recent rows (rotated with K and V, if they are)."""
        recent_k, recent_v = cache.write(meta.layout.recent, k, v)
        if cache.rotation is not None:
            q = q @ cache.rotation
        tables, lens, key_start, _, _ = self._rows(meta, cache.block_size)
        out = paged_attention.paged_decode_lowbit(
            q.contiguous(), cache.k_codes, cache.v_codes, cache.key_params, cache.value_params,
            recent_k, recent_v, meta.layout.recent.row_start, tables, lens, key_start,
            meta.sliding_window, scale, meta.sink_tokens, cache.bits, cache.residual)
        return out if cache.rotation is None else out @ cache.rotation.T

    def _attend_in_place(self, meta: PagedAttentionMetadata, cache: KVCacheLayer,
                         q: torch.Tensor, scale: float) -> torch.Tensor:
        """Every token of the step, decodes and prefill chunks alike, through the kernel: each
        query over the keys before its own position, so a prompt's numbers do not depend on
        how it was split into chunks or on what was cached before it."""
        tables, lens, key_start, tree_base, tree_bits = self._rows(meta, cache.block_size)
        return paged_attention.paged_decode(
            q, cache.k_cache, cache.v_cache, getattr(cache, "k_scales", None),
            getattr(cache, "v_scales", None), tables, lens, key_start, meta.sliding_window,
            scale, tree_base, tree_bits, meta.sink_tokens, getattr(cache, "demoted_scales", None))

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


def _rows_of_tokens(layout: PagedStepLayout, block_size: int):
    """(tables [N, W], lens [N], key_start, tree_base, tree_bits) giving every token of the
    step its sequence's blocks and its own context length (its position + 1); the tree
    tensors (None when the step has no tree) give a tree row its path. A pure decode step is
    its layout; with prefill chunks every table is shifted to start at position 0 (left-padded
    with block 0, which no query reads: a table starts past key 0 only for a sliding window,
    whose keys lie after it)."""
    if not layout.prefills:
        return (layout.decode_block_tables, layout.decode_context_lens,
                layout.decode_key_start, None, None)
    nd = layout.num_decode_tokens
    parts = []                                   # (pad blocks, table [rows, w], lens [rows])
    if nd:
        parts.append((layout.decode_key_start // block_size, layout.decode_block_tables,
                      layout.decode_context_lens))
    for chunk in layout.prefills:
        table = chunk.block_table
        if chunk.tree is None:
            lens = torch.arange(chunk.start + 1, chunk.context_len + 1, device=table.device)
        else:
            lens = chunk.start + 1 + torch.tensor(chunk.tree.depths, device=table.device)
        parts.append((chunk.key_start // block_size, table[None].expand(chunk.query_len, -1),
                      lens))
    width = max(pad + t.shape[1] for pad, t, _ in parts)
    device = layout.slot_mapping.device
    tables = torch.zeros(sum(t.shape[0] for _, t, _ in parts), width, dtype=torch.int32,
                         device=device)
    row = 0
    for pad, t, _ in parts:
        tables[row:row + t.shape[0], pad:pad + t.shape[1]] = t
        row += t.shape[0]
    lens = torch.cat([n.to(torch.int32) for _, _, n in parts])
    return (tables, lens, 0) + _tree_paths(layout, tables.shape[0], device)


def _tree_paths(layout: PagedStepLayout, rows: int, device: torch.device):
    """(tree_base [N], tree_bits [N]) for the kernel when a chunk of the step is a tree; any
    other row gets no bits (its keys are its prefix)."""
    if all(chunk.tree is None for chunk in layout.prefills):
        return None, None
    base, bits = [0] * rows, [0] * rows
    row = layout.num_decode_tokens
    for chunk in layout.prefills:
        if chunk.tree is not None:
            base[row:row + chunk.query_len] = [chunk.start] * chunk.query_len
            bits[row:row + chunk.query_len] = chunk.tree.bits
        row += chunk.query_len
    return tuple(torch.tensor(v, dtype=torch.long, device=device) for v in (base, bits))
