"""Paged attention that reads K/V in place: one FlexAttention call per layer and step.

The layer's KV pool, [blocks, block_size, KV heads, D], is viewed (not copied) as one key
sequence [1, KV heads, blocks * block_size, D]; the step's new tokens, decodes and prefill chunks
together, are one query sequence [1, H, N, D], grouped over the KV heads by the kernel
(`enable_gqa`: K/V are never repeated per query head). Which slots each token may read, its
own sequence's blocks up to its position and inside its window, is the step's mask_mod and block
mask (`flex_metadata.py`); the kernel visits only the blocks the block mask lists. As in vLLM's
flex_attention backend. The gather path (`paged.py`) stays the reference.

On CUDA the call is compiled (`torch.compile`: Triton kernels; the first steps of a shape pay the
compilation). On the CPU FlexAttention runs its unfused eager implementation, which scores every
query against the whole pool: a reference path for tests and measurements, not the CPU default
(`backends.py` says what was measured).

Not covered, so they stay on the gather path: quantized caches (see `backends.py`). The models
here use no attention-logit soft-capping (config.json values that ask for it are refused when
the config is read), so no score_mod is needed; the logits' scale is the layer's."""
from __future__ import annotations

import functools
import math
import warnings

import torch
from torch.nn.attention.flex_attention import flex_attention

from kvslim.attention.flex_metadata import Q_TILE, FlexAttentionMetadata
from kvslim.attention.kv_cache import KVCacheLayer, QuantizedKVCacheLayer
from kvslim.attention.latent_cache import QuantizedLatentKVCacheLayer

# The one warning the eager implementation gives: that it is not the fused kernel.
_EAGER_WARNING = "flex_attention called without torch.compile"


class FlexPagedAttention:
    def __init__(self, kv_caches: list[KVCacheLayer], metas: list[FlexAttentionMetadata]):
        """metas: one per layer (`build_flex_layer_metadata`)."""
        if any(isinstance(c, (QuantizedKVCacheLayer, QuantizedLatentKVCacheLayer))
               for c in kv_caches):
            raise ValueError("FlexPagedAttention reads the cache as stored: a quantized cache "
                             "takes the gather path")
        self.kv_caches, self.layer_metas = kv_caches, metas
        self.flex = flex_function(kv_caches[0].device, kv_caches[0].block_size)

    def caches_latent(self, layer_idx: int) -> bool:
        """MLA's latent rows (latent_cache.py): one KV head, the value a view of the key."""
        return self.kv_caches[layer_idx].latent

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [N, H, D]; k, v [N, KVH, D] for the step's new tokens (a latent cache: v is a view
        of k's first Dv entries). Returns [N, H, Dv]."""
        meta = self.layer_metas[layer_idx]
        cache = self.kv_caches[layer_idx]
        cache.write(meta.step.slot_mapping, k, v)      # read back below, with the context
        out = self.flex(q.transpose(0, 1)[None], pool_view(cache.k_cache),
                        pool_view(cache.v_cache), block_mask=meta.block_mask, scale=scale,
                        enable_gqa=True)
        return out[0].transpose(0, 1)


def pool_view(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, KVH, D] -> [1, KVH, blocks * block_size, D], a view."""
    return cache.flatten(0, 1).transpose(0, 1)[None]


def flex_function(device: torch.device, block_size: int):
    """The FlexAttention callable for `device`: compiled with this cache's tile sizes on CUDA,
    eager elsewhere."""
    if device.type != "cuda":
        return _eager_flex
    # The block mask's tiles are Q_TILE query rows by one cache block: the kernel's tiles must
    # divide them. BACKEND="TRITON" keeps the main kernel for short queries too (the
    # flex-decoding kernel wants kv tiles of its own size).
    options = {"BACKEND": "TRITON", "BLOCK_M": Q_TILE, "BLOCK_N": math.gcd(block_size, 64)}
    return functools.partial(_compiled_flex(), kernel_options=options)


# Compiled programs the one flex function may hold. Each step shape the engine meets (CUDA
# graphs' batch x table-width captures; the eager path's token counts until dynamo makes them
# symbolic) can be one: the first GPU run hit dynamo's default of 8 while capturing graphs, and
# fullgraph=True turns that into a hard failure.
FLEX_RECOMPILE_LIMIT = 128


@functools.cache
def _compiled_flex():
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit,
                                             4 * FLEX_RECOMPILE_LIMIT)
    return torch.compile(flex_attention, fullgraph=True)


def _eager_flex(*args, **kwargs) -> torch.Tensor:
    # Unfused on purpose (see the module docstring): silence that one warning, and only here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EAGER_WARNING, category=UserWarning)
        return flex_attention(*args, **kwargs)
