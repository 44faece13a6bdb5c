"""Embeddings: each input's final normed hidden states (after the model's last norm, before
lm_head) pooled into one vector and L2-normalised. "last" takes the last token's, what vLLM
pools a decoder-only model with by default (only the last token has seen the whole input);
"mean" averages over the input's tokens.

The inputs run as dense causal passes over left-padded batches (`CausalLM.forward` without a
paged context): no KV-cache block is read or written, so nothing outlives the call and the
blocks of requests being decoded are never touched."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvslim.errors import InvalidRequestError
from kvslim.models.causal_lm import CausalLM

POOLING_METHODS = ("last", "mean")


@torch.inference_mode()
def embed_token_lists(model: CausalLM, token_lists: list[list[int]], pooling: str,
                      max_batch_tokens: int) -> list[list[float]]:
    """One unit vector (float32 values) per token list, in order. Lists of close lengths run
    together, each batch at most `max_batch_tokens` once padded (a longer list runs alone)."""
    if pooling not in POOLING_METHODS:
        raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_METHODS)}, "
                                  f"got {pooling!r}", "pooling")
    vectors: list[list[float]] = [[] for _ in token_lists]
    for batch in length_batches([len(t) for t in token_lists], max_batch_tokens):
        pooled = _embed_batch(model, [token_lists[i] for i in batch], pooling)
        for i, vector in zip(batch, pooled.tolist()):
            vectors[i] = vector
    return vectors


def length_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """The indexes of `lengths` in batches, shortest first: a batch is padded to its longest, so
    sorting keeps the padding small; a batch grows while rows x longest fits the budget."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if batches and (len(batches[-1]) + 1) * lengths[i] <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _embed_batch(model: CausalLM, token_lists: list[list[int]], pooling: str) -> torch.Tensor:
    """[len(token_lists), hidden] unit vectors from one forward pass."""
    width = max(len(t) for t in token_lists)
    # Left padding puts every row's last token in the last column; the padding rows' own
    # outputs are never read.
    ids = [[0] * (width - len(t)) + t for t in token_lists]
    real = [[False] * (width - len(t)) + [True] * len(t) for t in token_lists]
    device = next(model.parameters()).device
    ids_t = torch.tensor(ids, device=device)
    real_t = torch.tensor(real, device=device)
    padded = any(len(t) < width for t in token_lists)
    hidden = model(ids_t, padding_mask=real_t if padded else None).float()
    if pooling == "last":
        pooled = hidden[:, -1]
    else:
        pooled = (hidden * real_t[..., None]).sum(1) / real_t.sum(1, keepdim=True)
    return F.normalize(pooled, dim=-1)
