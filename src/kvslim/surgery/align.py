"""The `align` conversion: regroup, rotate, then merge KV heads — better than mean pooling.

Mean pooling averages heads that live in unrelated bases. But a head's keys and values can be
rotated without changing the model, as long as the matching queries / output columns rotate too:
- values: any orthogonal R on a KV head's values, with o_proj's columns for its query heads
  multiplied by R, leaves the attention output unchanged;
- keys: RoPE rotates each frequency pair (dims j, j + d/2) by a position-dependent angle, so only
  a fixed rotation per frequency pair commutes with it; applied to the keys and to the queries
  of that head, every attention logit is unchanged.
So, per layer, with activations from calibration text:
1. group the source KV heads so that heads that align well share a group (exhaustive search over
   partitions when small, greedy otherwise), permuting query heads and o_proj columns to match;
2. rotate each head of a group into the group's common basis (generalised Procrustes; per
   frequency pair for keys);
3. merge: keys as a per-frequency-pair mean weighted by the energy of the queries that read
   them, values as the least-squares fit of the group's output after o_proj."""
from __future__ import annotations

import itertools
import math

import torch
from tqdm import tqdm

from kvslim.models.causal_lm import CausalLM
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.surgery.calibrate import attention_inputs

PROCRUSTES_ITERS = 4
MAX_EXHAUSTIVE_PARTITIONS = 5000


def align_state_dict(model: CausalLM, tokenizer: Tokenizer, kv_heads: list[int], calib,
                     num_samples: int, seq_len: int, show_progress: bool = True
                     ) -> dict[str, torch.Tensor]:
    """The state dict with layer i's KV heads merged into kv_heads[i]."""
    config = model.config
    inputs = attention_inputs(model, tokenizer, calib, num_samples, seq_len, show_progress)
    state = {k: v.detach().clone().float() for k, v in model.hf_state_dict().items()}
    for i, x in enumerate(tqdm(inputs, desc="aligning layers", unit="layer",
                               disable=not show_progress)):
        prefix = f"model.layers.{i}.self_attn."
        merged = merge_layer({n: state[prefix + n] for n in _ATTN_NAMES if prefix + n in state},
                             x, config.num_attention_heads, config.kv_heads_of(i), kv_heads[i],
                             config.head_dim)
        state.update({prefix + n: t for n, t in merged.items()})
    return state


_ATTN_NAMES = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
               "v_proj.weight", "v_proj.bias", "o_proj.weight", "o_proj.bias")


def merge_layer(w: dict[str, torch.Tensor], x: torch.Tensor, num_heads: int, src_kv: int,
                dst_kv: int, head_dim: int) -> dict[str, torch.Tensor]:
    """One layer's attention weights with `src_kv` KV heads -> `dst_kv` KV heads."""
    heads = split_heads(w, num_heads, src_kv, head_dim)
    keys = [project(x, heads["k"][s], heads["kb"][s]) for s in range(src_kv)]
    values = [project(x, heads["v"][s], heads["vb"][s]) for s in range(src_kv)]
    groups = choose_groups(keys, values, dst_kv)
    out_heads = {"q": [], "qb": [], "o": [], "k": [], "kb": [], "v": [], "vb": []}
    per_q = num_heads // src_kv
    for group in groups:
        q_rows = [[heads["q"][s * per_q + j] for j in range(per_q)] for s in group]
        q_bias = [[heads["qb"][s * per_q + j] for j in range(per_q)] for s in group]
        o_cols = [[heads["o"][s * per_q + j] for j in range(per_q)] for s in group]
        k, kb, q_rows, q_bias = merge_keys([heads["k"][s] for s in group],
                                           [heads["kb"][s] for s in group],
                                           [keys[s] for s in group], q_rows, q_bias, x)
        v, vb, o_cols = merge_values([heads["v"][s] for s in group],
                                     [heads["vb"][s] for s in group],
                                     [values[s] for s in group], o_cols)
        out_heads["k"].append(k)
        out_heads["kb"].append(kb)
        out_heads["v"].append(v)
        out_heads["vb"].append(vb)
        out_heads["q"] += [r for rows in q_rows for r in rows]
        out_heads["qb"] += [b for bs in q_bias for b in bs]
        out_heads["o"] += [c for cols in o_cols for c in cols]
    return join_heads(w, out_heads)


# ---- head bookkeeping ---------------------------------------------------------------------
def split_heads(w, num_heads, kv_heads, d):
    def rows(t, n):
        return list(t.reshape(n, d, -1)) if t is not None else [None] * n

    def bias(name, n):
        t = w.get(name)
        return list(t.reshape(n, d)) if t is not None else [torch.zeros(d)] * n

    return {"q": rows(w["q_proj.weight"], num_heads), "qb": bias("q_proj.bias", num_heads),
            "k": rows(w["k_proj.weight"], kv_heads), "kb": bias("k_proj.bias", kv_heads),
            "v": rows(w["v_proj.weight"], kv_heads), "vb": bias("v_proj.bias", kv_heads),
            # o_proj columns of a head: [hidden, d]
            "o": list(w["o_proj.weight"].reshape(w["o_proj.weight"].shape[0], num_heads, d)
                      .permute(1, 0, 2))}


def join_heads(w, h):
    out = {"q_proj.weight": torch.cat(h["q"]), "k_proj.weight": torch.cat(h["k"]),
           "v_proj.weight": torch.cat(h["v"]),
           "o_proj.weight": torch.stack(h["o"], dim=1).reshape(w["o_proj.weight"].shape[0], -1)}
    for name, key in (("q_proj.bias", "qb"), ("k_proj.bias", "kb"), ("v_proj.bias", "vb")):
        if name in w:
            out[name] = torch.cat(h[key])
    if "o_proj.bias" in w:
        out["o_proj.bias"] = w["o_proj.bias"]
    return out


def project(x, weight, bias):
    return x @ weight.T + bias


# ---- grouping -----------------------------------------------------------------------------
def _as_complex(a: torch.Tensor) -> torch.Tensor:
    """[..., d] real (rotate-half layout) -> [..., d/2] complex frequency pairs."""
    half = a.shape[-1] // 2
    return torch.complex(a[..., :half].double(), a[..., half:].double())


def pair_cost(ki, kj, vi, vj) -> float:
    """Relative residual after the best alignment of head i onto head j (keys per frequency
    pair, values by a full orthogonal rotation); 0 means interchangeable."""
    ci, cj = _as_complex(ki), _as_complex(kj)
    k_energy = (ci.abs() ** 2).sum() + (cj.abs() ** 2).sum()
    k_res = k_energy - 2 * (ci.conj() * cj).sum(0).abs().sum()
    vi, vj = vi.double(), vj.double()
    v_energy = (vi ** 2).sum() + (vj ** 2).sum()
    v_res = v_energy - 2 * torch.linalg.svdvals(vi.T @ vj).sum()
    return float(k_res / k_energy + v_res / v_energy)


def choose_groups(keys, values, dst_kv) -> list[list[int]]:
    src = len(keys)
    size = src // dst_kv
    if size == 1:
        return [[s] for s in range(src)]
    if dst_kv == 1:
        return [list(range(src))]
    cost = torch.zeros(src, src, dtype=torch.float64)
    for i, j in itertools.combinations(range(src), 2):
        cost[i, j] = cost[j, i] = pair_cost(keys[i], keys[j], values[i], values[j])

    def group_cost(g):
        return sum(cost[a, b] for a, b in itertools.combinations(g, 2))

    if _num_partitions(src, size) <= MAX_EXHAUSTIVE_PARTITIONS:
        best = min(_partitions(list(range(src)), size), key=lambda p: sum(map(group_cost, p)))
    else:
        best, left = [], list(range(src))
        while left:                              # greedy: grow a group around the first head
            group = [left.pop(0)]
            while len(group) < size:
                nxt = min(left, key=lambda c: sum(cost[c, g] for g in group))
                group.append(nxt)
                left.remove(nxt)
            best.append(group)
    return sorted((sorted(g) for g in best), key=lambda g: g[0])


def _num_partitions(n, size):
    groups = n // size
    return math.factorial(n) // (math.factorial(size) ** groups * math.factorial(groups))


def _partitions(items, size):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = [r for r in rest if r not in others]
        for tail in _partitions(remaining, size):
            yield [[first, *others]] + tail


# ---- keys: per-frequency-pair rotations, query-energy-weighted mean -----------------------
def rotate_pairs(t: torch.Tensor, phase: torch.Tensor, dim: int) -> torch.Tensor:
    """Rotate the frequency pairs along `dim` (size d, rotate-half layout) by `phase` [d/2]."""
    t = t.transpose(0, dim) if dim else t
    half = t.shape[0] // 2
    a, b = t[:half], t[half:]
    shape = (-1,) + (1,) * (t.dim() - 1)
    cos, sin = phase.cos().to(t.dtype).reshape(shape), phase.sin().to(t.dtype).reshape(shape)
    out = torch.cat([a * cos - b * sin, a * sin + b * cos])
    return out.transpose(0, dim) if dim else out


def merge_keys(k_rows, k_bias, keys, q_rows, q_bias, x):
    """k_rows[s] [d, hidden]; keys[s] [N, d] pre-RoPE; q_rows[s][j] [d, hidden] for the query
    heads reading head s. Returns merged k rows/bias and the rotated query rows/biases."""
    cks = [_as_complex(k) for k in keys]                       # [N, d/2] each
    phases = [torch.zeros(cks[0].shape[1], dtype=torch.float64) for _ in cks]
    # Weight of each (head, pair): energy of the queries that read it.
    weights = torch.stack([sum((_as_complex(project(x, r, b)).abs() ** 2).mean(0)
                               for r, b in zip(rows, bs)) for rows, bs in zip(q_rows, q_bias)])
    ref = cks[0]
    for _ in range(PROCRUSTES_ITERS):
        phases = [torch.angle((ck.conj() * ref).sum(0)) for ck in cks]
        aligned = torch.stack([ck * torch.exp(1j * p) for ck, p in zip(cks, phases)])
        ref = (aligned * weights[:, None, :]).sum(0) / weights.sum(0).clamp_min(1e-12)
    w = (weights / weights.sum(0).clamp_min(1e-12)).float()      # [heads, d/2]
    w_full = torch.cat([w, w], dim=1)                            # both halves of each pair
    rot_k = [rotate_pairs(k, p.float(), 0) for k, p in zip(k_rows, phases)]
    rot_kb = [rotate_pairs(b, p.float(), 0) for b, p in zip(k_bias, phases)]
    merged = sum(wf[:, None] * r for wf, r in zip(w_full, rot_k))
    merged_b = sum(wf * r for wf, r in zip(w_full, rot_kb))
    new_q = [[rotate_pairs(r, p.float(), 0) for r in rows] for rows, p in zip(q_rows, phases)]
    new_qb = [[rotate_pairs(b, p.float(), 0) for b in bs] for bs, p in zip(q_bias, phases)]
    return merged, merged_b, new_q, new_qb


# ---- values: orthogonal Procrustes, output-weighted least squares -------------------------
def merge_values(v_rows, v_bias, values, o_cols):
    """v_rows[s] [d, hidden]; values[s] [N, d]; o_cols[s][j] [hidden, d]."""
    if len(values) == 1:
        return v_rows[0], v_bias[0], o_cols
    vals = [v.double() for v in values]
    rots = [torch.eye(vals[0].shape[1], dtype=torch.float64) for _ in vals]
    ref = vals[0]
    for _ in range(PROCRUSTES_ITERS):
        rots = [_procrustes(v, ref) for v in vals]
        ref = sum(v @ r for v, r in zip(vals, rots)) / len(vals)
    # Rotated heads: V_s R_s = x (R_s^T W_s)^T; o_proj columns become O R_s.
    b_mats = [v_rows[s].double().T @ rots[s] for s in range(len(vals))]          # [hidden, d]
    biases = [v_bias[s].double() @ rots[s] for s in range(len(vals))]
    new_o = [[c.double() @ rots[s] for c in o_cols[s]] for s in range(len(vals))]
    # The merged head minimises sum_s |(V_s R_s - V) O_s^T|^2: V = sum(B_s P_s) (sum P_s)^-1.
    p = [sum(c.T @ c for c in cols) for cols in new_o]
    p_sum = sum(p)
    p_sum = p_sum + 1e-6 * p_sum.diagonal().mean() * torch.eye(p_sum.shape[0], dtype=p_sum.dtype)
    inv = torch.linalg.inv(p_sum)
    merged = sum(b @ ps for b, ps in zip(b_mats, p)) @ inv
    merged_b = sum(b @ ps for b, ps in zip(biases, p)) @ inv
    return (merged.T.float(), merged_b.float(),
            [[c.float() for c in cols] for cols in new_o])


def _procrustes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Orthogonal R minimising |a R - b|."""
    u, _, vh = torch.linalg.svd(a.T @ b)
    return u @ vh
