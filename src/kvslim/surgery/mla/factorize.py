"""One Llama attention layer as DeepSeek-V2's latent attention (q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj; o_proj is the source's).

Per query head i of KV group g, with the mixing U_f and kept counts m_f of frequencies.py:
- RoPE slot (f, j < m_f): key rows sum_h U_f[j, h] W_k[h, pair f] (the shared key, rotated), query
  rows U_f[j, g] W_q[i, pair f];
- every frequency with m_f < K loses its rotation: query rows W_q[i, pair f], key rows the part
  of group g's pair-f key the kept components do not carry, (I - U_m^T U_m)[g] W_k[:, pair f]
  (zero when m_f = K, so such a frequency has no un-rotated dims: qk_nope_head_dim = 2 x the
  number of frequencies with m_f < K);
- the un-rotated keys and the values of all groups, stacked as rows M [K (nope + d), hidden], are
  one joint latent: B = the top-R eigenvectors of M C M^T (mha2mla: C = I, the SVD of the
  weights; transmla: C = the calibration inputs' covariance, activation PCA, after scaling the
  keys to the values' energy, TransMLA's balancing, undone in the queries); kv_a's latent rows
  are B^T M and head i's kv_b rows group g's rows of B. R = rank(M) reproduces M x exactly.
- the attention scale: DeepSeek's is (nope + rope)^-1/2, the source's d^-1/2; the queries carry
  the ratio.

DeepSeek normalises the latent (kv_a_layernorm, an RMSNorm with epsilon 1e-6) before kv_b; the
source has no such norm. `calibrated` sets its weight to the latent's RMS on the calibration
inputs (or, without them, inputs of covariance diag(g^2), g the layer's input norm weight: a
normalised hidden state of unit RMS), so that a token of typical RMS passes unchanged and others
are rescaled; `exact` scales the latent rows by alpha so that the latent's RMS is ~1e-9, far
below sqrt(epsilon), where RMSNorm is y / sqrt(eps) to a relative 1e-12, and the weight
sqrt(eps) / alpha undoes it: exact to float rounding, with rows ~1e-9 that plain AdamW's first
steps would swamp (kvslim uptrain trains them at their own scale: train/latent_rows.py). Not
for float16, whose smallest numbers are ~6e-8."""
from __future__ import annotations

import math

import torch

from kvslim.layers.latent_attention import LATENT_NORM_EPS
from kvslim.surgery.mla.frequencies import pairs, slots

EXACT_LATENT_RMS = 1e-9


def mla_layer(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cov: torch.Tensor,
              u: torch.Tensor, kept: list[int], method: str, rank: int,
              latent_norm: str) -> dict[str, torch.Tensor]:
    """The layer's DeepSeek tensors (float64) by their names under `self_attn.`."""
    kv, d = u.shape[1], wk.shape[0] // u.shape[1]
    heads = wq.shape[0] // d
    group = torch.arange(heads) // (heads // kv)
    qp, kp = pairs(wq, heads), pairs(wk, kv)
    q_rope, k_rope = _rope_rows(qp, kp, u, kept, group)
    q_nope, k_nope = _nope_rows(qp, kp, u, kept)
    values = wv.reshape(kv, d, -1)
    balance = _balance(k_nope, values, cov) if method == "transmla" else 1.0
    rows = torch.cat((balance * k_nope.flatten(1, 2), values), dim=1)   # [K, nope + d, hidden]
    basis = _basis(rows.flatten(0, 1), cov if method == "transmla" else None, rank)
    latent = basis.T @ rows.flatten(0, 1)                               # [R, hidden]
    alpha, weight = _latent_scale(latent, cov, latent_norm)
    nope, width = q_nope.shape[1] * 2, q_rope.shape[1] * 2
    scale = math.sqrt((nope + width) / d)
    q = torch.cat((q_nope.flatten(1, 2) / balance, q_rope.flatten(1, 2)), dim=1) * scale
    kv_b = basis.reshape(kv, nope + d, rank)[group]                      # [H, nope + d, R]
    return {"q_proj.weight": q.flatten(0, 1),
            "kv_a_proj_with_mqa.weight": torch.cat((alpha * latent, k_rope.flatten(0, 1))),
            "kv_a_layernorm.weight": torch.full((rank,), weight, dtype=latent.dtype),
            "kv_b_proj.weight": kv_b.flatten(0, 1)}


def _rope_rows(qp, kp, u, kept, group):
    """Queries [H, slots, 2, hidden] and the shared key [slots, 2, hidden] of the kept slots
    (each slot's pair is DeepSeek's interleaved (2a, 2a + 1))."""
    order = slots(kept)
    fs = torch.tensor([f for f, _ in order], dtype=torch.long)
    js = torch.tensor([j for _, j in order], dtype=torch.long)
    coef = u[fs, js][:, group]                                           # [slots, H]
    q = torch.einsum("sh,hsci->hsci", coef, qp[:, fs])
    k = torch.einsum("sh,hsci->sci", u[fs, js], kp[:, fs])
    return q, k


def _nope_rows(qp, kp, u, kept):
    """Queries [H, n, 2, hidden] and each group's un-rotated key [K, n, 2, hidden] of the n
    frequencies not wholly kept."""
    kv = kp.shape[0]
    fs = [f for f, m in enumerate(kept) if m < kv]
    eye = torch.eye(kv, dtype=u.dtype)
    proj = torch.stack([eye - u[f, :kept[f]].T @ u[f, :kept[f]] for f in fs]) if fs else \
        u.new_zeros(0, kv, kv)
    k = torch.einsum("fgh,hfci->gfci", proj, kp[:, fs])
    return qp[:, fs], k


def _balance(k_nope: torch.Tensor, values: torch.Tensor, cov: torch.Tensor) -> float:
    """sqrt(E||v||^2 / E||k_nope||^2): keys scaled to the values' energy before the PCA."""
    k = torch.einsum("ki,ij,kj->", k_nope.flatten(0, 2), cov, k_nope.flatten(0, 2)).item()
    v = torch.einsum("ki,ij,kj->", values.flatten(0, 1), cov, values.flatten(0, 1)).item()
    return math.sqrt(v / k) if k > 0 and v > 0 else 1.0


def _basis(rows: torch.Tensor, cov: torch.Tensor | None, rank: int) -> torch.Tensor:
    """Orthonormal [rows, R]: the top-R eigenvectors of rows C rows^T (C = I when None)."""
    gram = rows @ rows.T if cov is None else rows @ cov @ rows.T
    _, vectors = torch.linalg.eigh(gram)
    return vectors.flip(-1)[:, :rank].contiguous()


def _latent_scale(latent: torch.Tensor, cov: torch.Tensor, latent_norm: str):
    """(alpha on the latent rows, kv_a_layernorm's weight) for `latent_norm`."""
    mean_square = torch.einsum("ri,ij,rj->", latent, cov, latent).item() / latent.shape[0]
    mean_square = mean_square if mean_square > 0 else 1.0
    if latent_norm == "exact":
        alpha = EXACT_LATENT_RMS / math.sqrt(mean_square)
        return alpha, math.sqrt(LATENT_NORM_EPS) / alpha
    return 1.0, math.sqrt(mean_square + LATENT_NORM_EPS)
