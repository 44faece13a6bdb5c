"""Which RoPE frequency pairs keep their rotation, and the RoPE config that rotates them.

A Llama key head rotates pair f (dims f and f + d/2) by position * inv_freq[f]. A rotation of one
pair commutes with any real mixing of the same pair across KV heads, so per layer and frequency
an orthogonal K x K matrix U_f may mix the KV heads' pair-f keys (the queries take U_f's column
of their own group, and every q.k is unchanged). mha2mla keeps U_f = I; transmla takes U_f from
the PCA of the pair-f keys on calibration text (TransMLA's RoRoPE), so that the first mixed
component carries most of the rotated energy. A "slot" is one (component j, frequency f): j < m_f
stay rotated in DeepSeek's one shared RoPE key, the rest lose their rotation.

The slots are scored as MHA2MLA's 2-norm criterion, RMS query norm times RMS key norm, summed
over the query heads that read the slot and over all layers: DeepSeek's RoPE frequencies are one
list for the whole model, so every layer keeps the same multiset of frequencies (m_f per
frequency). mha2mla keeps whole frequencies (m_f = K: every KV head); transmla adds components
one at a time, best first, each frequency's in PCA order."""
from __future__ import annotations

import torch

from kvslim.layers.rope import rope_inv_freq
from kvslim.models.config import ModelConfig


def pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Projection rows [heads * d, hidden] -> [heads, d/2, 2, hidden]: pair f's (f, f + d/2)."""
    hidden = w.shape[-1]
    return w.reshape(heads, 2, -1, hidden).transpose(1, 2)


def energy(w: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """E ||w x||^2 per leading index of w [..., 2, hidden] (its pair summed), x of covariance cov."""
    return torch.einsum("...ci,ij,...cj->...", w, cov, w)


def mixing(kp: torch.Tensor, cov: torch.Tensor, method: str) -> torch.Tensor:
    """U [d/2, K, K] (rows: components, best first) for keys kp [K, d/2, 2, hidden]."""
    kv, half = kp.shape[0], kp.shape[1]
    if method == "mha2mla":
        return torch.eye(kv, dtype=kp.dtype).expand(half, kv, kv).clone()
    gram = torch.einsum("hfci,ij,gfcj->fhg", kp, cov, kp)          # [d/2, K, K]
    _, vectors = torch.linalg.eigh(gram)                             # ascending
    return vectors.flip(-1).transpose(1, 2).contiguous()


def slot_scores(qp: torch.Tensor, kp: torch.Tensor, u: torch.Tensor,
                cov: torch.Tensor) -> torch.Tensor:
    """One layer's score [K, d/2] of each slot (component j, frequency f)."""
    heads, kv = qp.shape[0], kp.shape[0]
    group = torch.arange(heads) // (heads // kv)
    mixed = torch.einsum("fjh,hfci->jfci", u, kp)
    key = energy(mixed, cov).clamp_min(0).sqrt()                    # [K, d/2]
    query = energy(qp, cov).clamp_min(0).sqrt()                     # [H, d/2]
    weight = u[:, :, group].abs()                                    # [d/2, K, H]
    return torch.einsum("fjh,hf->jf", weight, query) * key


def choose_kept(scores: torch.Tensor, method: str, rope_dim: int) -> list[int]:
    """m_f per frequency from the model's summed scores [K, d/2] for rope_dim dims per query
    head: whole frequencies (mha2mla) or rope_dim / 2 components in all (transmla)."""
    kv, half = scores.shape
    kept = [0] * half
    if method == "mha2mla":
        for f in scores.sum(0).argsort(descending=True)[:rope_dim // 2].tolist():
            kept[f] = kv
        return kept
    for _ in range(rope_dim // 2):
        nxt = [scores[kept[f], f].item() if kept[f] < kv else -1.0 for f in range(half)]
        kept[max(range(half), key=nxt.__getitem__)] += 1
    return kept


def slots(kept: list[int]) -> list[tuple[int, int]]:
    """The shared key's pairs in order, (frequency, component): fastest frequencies first, as
    DeepSeek's own list runs."""
    return [(f, j) for f, m in enumerate(kept) for j in range(m)]


def source_inv_freq(config: ModelConfig) -> torch.Tensor:
    return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).double()


def rope_parameters(config: ModelConfig, kept: list[int]) -> dict:
    """config.json `rope_parameters` rotating slot a at the source frequency of its pair: the
    plain RoPE of the shared key's width when that is what the slots' frequencies are (every
    frequency once, no scaling), else LongRoPE's per-frequency factors (the same short and long
    ones, attention factor 1: transformers and kvslim both divide each frequency by its
    factor, so any list of frequencies can be written)."""
    want = source_inv_freq(config)[[f for f, _ in slots(kept)]]
    width = 2 * len(want)
    plain = rope_inv_freq(width, config.rope_theta, None).double()
    params = {"rope_type": "default", "rope_theta": config.rope_theta}
    if torch.allclose(plain, want, rtol=1e-6, atol=0):
        return params
    factors = (plain / want).tolist()
    return {**params, "rope_type": "longrope", "short_factor": factors, "long_factor": factors,
            "factor": 1.0, "attention_factor": 1.0,
            "original_max_position_embeddings": config.max_position_embeddings}
