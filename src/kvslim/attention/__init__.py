"""Attention backends. A backend is a context object built once per forward pass from metadata
built in one place; each attention layer calls `context.attend(layer_idx, q, k, v)` and nothing
else.

- `DenseAttention`: causal attention over a padded [batch, time] block (training, perplexity).
- `PagedAttention`: the engine's flat batch of prefill chunks and decodes over a paged KV cache,
  reading the `PagedAttentionMetadata` that `build_paged_metadata` makes from the step's layout;
  each layer's cache is a `KVCacheLayer` (model dtype) or `QuantizedKVCacheLayer` (int8/fp8).

Both group query heads over KV heads by reshaping (see `grouped.py`): K and V are never copied
once per query head, and the same torch code runs on CPU and CUDA."""
from kvslim.attention.dense import DenseAttention
from kvslim.attention.kv_cache import (KV_SCALE_DTYPE, QUANTIZED_KV_DTYPES, KVCacheLayer, QuantizedKVCacheLayer,
                                       resolve_kv_cache_dtype)
from kvslim.attention.metadata import (PagedAttentionMetadata, PagedStepLayout, PrefillChunk,
                                       build_layer_metadata, build_paged_metadata)
from kvslim.attention.paged import PagedAttention

__all__ = ["KV_SCALE_DTYPE", "QUANTIZED_KV_DTYPES", "DenseAttention", "KVCacheLayer", "QuantizedKVCacheLayer",
           "resolve_kv_cache_dtype", "PagedAttention", "PagedAttentionMetadata", "PagedStepLayout",
           "PrefillChunk", "build_layer_metadata", "build_paged_metadata"]
