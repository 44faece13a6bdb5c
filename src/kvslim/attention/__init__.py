"""Attention backends. A backend is a context object built once per forward pass (one place builds
the metadata); each attention layer calls `context.attend(layer_idx, q, k, v)` and nothing else.

- `DenseAttention`: causal attention over a padded [batch, time] block (training, perplexity).
- `PagedAttention`: the engine's flat batch of prefill chunks and decodes over a paged KV cache.

Both group query heads over KV heads by reshaping (see `grouped.py`): K and V are never copied
once per query head, and the same torch code runs on CPU and CUDA."""
from kvslim.attention.dense import DenseAttention
from kvslim.attention.paged import PagedAttention, PagedAttentionMetadata

__all__ = ["DenseAttention", "PagedAttention", "PagedAttentionMetadata"]
