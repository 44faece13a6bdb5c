"""Attention backends. A backend is a context object built once per forward pass from metadata
built in one place; each attention layer calls `context.attend(layer_idx, q, k, v)` and nothing
else.

- `DenseAttention`: causal attention over a padded [batch, time] block (training, perplexity).
- `PagedAttention`: the engine's flat batch of prefill chunks and decodes over a paged KV cache,
  gathering each sequence's context, reading the `PagedAttentionMetadata` that
  `build_paged_metadata` makes from the step's layout; each layer's cache is a `KVCacheLayer`
  (model dtype) or `QuantizedKVCacheLayer` (int8/fp8); an MLA model's, `LatentKVCacheLayer`
  (`latent_cache.py`: one row per token, no heads). The reference path.
- `FlexPagedAttention`: the same step in one FlexAttention call per layer, reading K/V in place
  through the block tables (`flex_metadata.py` builds its mask once per step).
- `backends.py`: which a step uses ("auto", "gather", "flex", or "kernel": `PagedAttention`
  with its decodes through kvslim's C++ kernel, reading the cache in place) and the one
  builder of the step's context.

All group query heads over KV heads without copying K/V per head (see `grouped.py`; FlexAttention
with `enable_gqa`)."""
from kvslim.attention.backends import (ATTENTION_BACKENDS, build_paged_attention,
                                       decode_kernel_usable, resolve_attention_backend)
from kvslim.attention.dense import DenseAttention
from kvslim.attention.kv_cache import (KV_CACHE_DTYPES, KV_SCALE_DTYPE, QUANTIZED_KV_DTYPES,
                                       KVCacheLayer, QuantizedKVCacheLayer,
                                       resolve_kv_cache_dtype)
from kvslim.attention.latent_cache import (LatentKVCacheLayer, QuantizedLatentKVCacheLayer,
                                           latent_cache_layers)
from kvslim.attention.metadata import (PagedAttentionMetadata, PagedStepLayout, PrefillChunk,
                                       build_layer_metadata, build_paged_metadata)
from kvslim.attention.paged import PagedAttention

__all__ = ["ATTENTION_BACKENDS", "KV_CACHE_DTYPES", "KV_SCALE_DTYPE", "QUANTIZED_KV_DTYPES",
           "DenseAttention", "FlexAttentionMetadata", "FlexPagedAttention", "KVCacheLayer",
           "LatentKVCacheLayer", "QuantizedKVCacheLayer", "QuantizedLatentKVCacheLayer",
           "PagedAttention", "PagedAttentionMetadata", "PagedStepLayout", "PrefillChunk",
           "build_flex_layer_metadata", "build_layer_metadata", "build_paged_attention",
           "build_paged_metadata", "decode_kernel_usable", "latent_cache_layers",
           "resolve_attention_backend", "resolve_kv_cache_dtype"]

# FlexAttention's backend loads when a step or a caller uses it (CUDA's; the CPU never does).
_FLEX = {"FlexPagedAttention": "kvslim.attention.flex",
         "FlexAttentionMetadata": "kvslim.attention.flex_metadata",
         "build_flex_layer_metadata": "kvslim.attention.flex_metadata"}


def __getattr__(name: str):
    if name in _FLEX:
        import importlib
        return getattr(importlib.import_module(_FLEX[name]), name)
    raise AttributeError(f"module 'kvslim.attention' has no attribute {name!r}")
