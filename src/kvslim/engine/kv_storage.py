"""`KVStorage`: the paged KV cache's tensors, allocated once as the `KVCachePlan` sizes them,
and each layer's cache object over them (attention/kv_cache.py, lowbit_cache.py,
latent_cache.py).

One pool of blocks, unless a per-layer KV plan mixes precisions (kv_cache/layer_plan.py): then
each precision's pool has storage of its own, indexed from 0 (the runner's block tables hold
pool-local ids, engine/block_table.py). Within a pool, position j of every group shares one
storage tensor: the layer at that position of whichever group holds a page writes there.
A block id means the same slots in every tensor of its pool; which group's layers it holds is
the block manager's business.

Under `--kv-pressure demote` each float32 layer also has the float16 scales of the int8 blocks
its bytes may hold (engine/kv_demotion.py), and `demote_blocks` moves blocks down."""
from __future__ import annotations

import torch

from kvslim.attention import (KV_SCALE_DTYPE, KVCacheLayer, QuantizedKVCacheLayer,
                              latent_cache_layers)
from kvslim.attention.kv_cache import quantize
from kvslim.device import host_tensor
from kvslim.dtypes import is_quantized_kv, packed_kv_bits
from kvslim.kernels.paged_attention import demoted_view
from kvslim.kv_cache.plan import DEMOTED_PER_BLOCK, KVCachePlan, recent_blocks
from kvslim.models.config import ModelConfig


class KVStorage:
    def __init__(self, mc: ModelConfig, plan: KVCachePlan, options, device: torch.device,
                 model_dtype: torch.dtype, reserved_blocks: int = 0):
        """Each pool's storage plus `reserved_blocks` per pool the block manager never hands
        out (the decode graphs' padding rows write there). `kv_caches`: each layer's cache, the
        storage at its position in its group's pool; `kv_cache` / `kv_scales`: the tensors of
        every pool; `pool_tensors`: by pool, what a block copy touches."""
        self.mc, self.plan, self.options = mc, plan, options
        self.device, self.model_dtype = device, model_dtype
        groups = plan.groups.groups
        self.kv_caches: list = [None] * mc.num_hidden_layers
        self.kv_cache: list[torch.Tensor] = []
        self.pool_tensors: list[list[torch.Tensor]] = []
        self.pool_storage: list[list] = []
        self.demoted_scales: list[torch.Tensor] = []    # per layer, under kv_pressure demote
        scales: list[torch.Tensor] = []
        for pool in plan.pools:
            storage, tensors, pool_scales = self._allocate_pool(
                pool.kv_dtype, groups[pool.groups[0]].layers, pool.num_blocks + reserved_blocks)
            packed, used = packed_kv_bits(pool.kv_dtype), set()
            for g in pool.groups:
                for j, layer in enumerate(groups[g].layers):
                    # a packed cache's recent rows are per group: the others get their own
                    self.kv_caches[layer] = (storage[j].with_own_recent()
                                             if packed and j in used else storage[j])
                used.update(range(len(groups[g].layers)))
            own = [t for g in pool.groups for layer in groups[g].layers
                   if packed and self.kv_caches[layer] not in storage
                   for t in (self.kv_caches[layer].recent_k, self.kv_caches[layer].recent_v)]
            self.kv_cache += tensors + own
            scales += pool_scales
            self.pool_tensors.append(tensors + own + pool_scales)
            self.pool_storage.append(storage)
        self.kv_scales = scales or None

    def _allocate_pool(self, kv_dtype, layers: tuple[int, ...], blocks: int):
        """One pool's storage per position in its groups (the layers of its first group):
        K/V tensors [K/V, blocks, block_size, kv_heads, head_dim] (an MLA model's: its latent
        rows, [1, blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim], key only), plus a
        quantized cache's scales [K/V, blocks, block_size, kv_heads]; a packed cache's codes
        and parameters (lowbit_cache.py). Returns (storage per position, tensors, scales)."""
        mc, bs, device = self.mc, self.plan.block_size, self.device
        bits = packed_kv_bits(kv_dtype)
        if bits:
            from kvslim.attention.lowbit_cache import LowBitKVCacheLayer
            storage = [LowBitKVCacheLayer.allocate(
                blocks, bs, mc.kv_heads_of(layer), mc.head_dim, self.options.max_num_seqs,
                recent_blocks(self.options, kv_dtype), bits, self.options.kv_hadamard, device)
                for layer in layers]
            return storage, [t for s in storage for t in s.tensors()], []
        shapes = ([(1, blocks, bs, 1)] * len(layers) if mc.mla else
                  [(2, blocks, bs, mc.kv_heads_of(layer)) for layer in layers])
        width = mc.mla.cache_width if mc.mla else mc.head_dim
        tensors = [torch.zeros(*shape, width, dtype=kv_dtype, device=device) for shape in shapes]
        scales = []
        if is_quantized_kv(kv_dtype):
            scales = [torch.zeros(shape, dtype=KV_SCALE_DTYPE, device=device) for shape in shapes]
        if mc.mla:
            storage = latent_cache_layers(tensors, scales or None, mc.mla.kv_lora_rank,
                                          self.model_dtype)
        elif not scales:
            if getattr(self.options, "kv_pressure", None) == "demote":
                self.demoted_scales = [torch.zeros(
                    2, DEMOTED_PER_BLOCK * blocks, *kv.shape[2:4], dtype=KV_SCALE_DTYPE,
                    device=device) for kv in tensors]
            storage = [KVCacheLayer(kv[0], kv[1], d) for kv, d in
                       zip(tensors, self.demoted_scales or [None] * len(tensors))]
        else:
            storage = [QuantizedKVCacheLayer(kv[0], kv[1], sc[0], sc[1], self.model_dtype)
                       for kv, sc in zip(tensors, scales)]
        return storage, tensors, scales

    def slot_bytes(self) -> int:
        """Bytes one token's slot takes in the allocated tensors, one group's layers, elements
        and scales: what the allocation really holds per token (checked against the planner);
        a packed cache's: its blocks over their tokens, rounded up (its recent rows are apart).
        Under a per-layer KV plan, every pool's over the groups (a group's share)."""
        total = 0
        for pool, storage, tensors in zip(self.plan.pools, self.pool_storage, self.pool_tensors):
            if packed_kv_bits(pool.kv_dtype):
                slot = -(-sum(s.block_bytes() for s in storage) // self.plan.block_size)
            else:
                slot = sum(t[:, 0, 0].numel() * t.element_size() for t in tensors)
            total += slot * len(pool.groups)
        total += sum(d[:, :DEMOTED_PER_BLOCK, 0].numel() * d.element_size()
                     for d in self.demoted_scales)
        return -(-total // len(self.plan.groups.groups))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write's (src, dst) block pairs, in the pool that holds each (its storage
        indexed from the pool's first block)."""
        for pool, tensors in zip(self.plan.pools, self.pool_tensors):
            mine = [(s - pool.first_block, d - pool.first_block) for s, d in copies
                    if pool.first_block <= s < pool.first_block + pool.num_blocks]
            if not mine:
                continue
            src, dst = host_tensor(list(zip(*mine)), torch.long, self.device)
            for layer in tensors:
                layer[:, dst] = layer[:, src]

    def demote_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Demotion's (float32 block, int8 block) pairs (engine/kv_demotion.py), in every
        layer: each source quantized as the int8 cache quantizes (per token and KV head), all
        read before any is written (an int8 block may lie in the bytes of a source)."""
        src, dst = host_tensor(list(zip(*copies)), torch.long, self.device)
        for kv, scales in zip(self.kv_cache, self.demoted_scales):
            codes, s = quantize(kv.index_select(1, src), torch.int8)
            for i in range(2):                                  # K, V
                demoted_view(kv[i])[dst] = codes[i]
                scales[i, dst] = s[i]
