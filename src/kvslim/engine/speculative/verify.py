"""Exact verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

For one sequence with drafts d_1..d_k, the target's distributions p_1..p_{k+1} at the k+1
positions (after temperature, top-k/top-p/min-p and penalties) and the proposer's q_1..q_k:
draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
token is drawn from normalize(max(0, p_i - q_i)) and the rest is dropped; when all k are
accepted a bonus token is drawn from p_{k+1}. Every emitted token is then distributed exactly
as a token drawn from the target. An n-gram draft is one-hot (q_i(d_i) = 1): the rule becomes
"accept with probability p_i(d_i)", the residual is p_i without d_i. Greedy requests accept
while the draft equals the target's argmax, then take the argmax: the output of plain greedy
decoding.

Typical acceptance (Medusa, Cai et al. 2024) is the option that is not exact: draft i is kept
while p_i(d_i) > min(threshold, alpha * exp(-H(p_i))) — likely enough, with the bar lowered where
the target itself is unsure — and at the first draft below the bar the token is drawn from p_i
itself. Emitted tokens are plausible but no longer distributed as the target's samples."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> list[int]:
    """target_logits [k+1, vocab] -> accepted drafts followed by the target's own token."""
    best = target_logits.argmax(dim=-1).tolist()
    out = []
    for i, token in enumerate(draft_tokens):
        if token != best[i]:
            break
        out.append(token)
    out.append(best[len(out)])
    return out


def verify_sampled(target_probs: torch.Tensor, draft_tokens: list[int],
                   draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None = None) -> list[int]:
    """target_probs [k+1, vocab], draft_probs [k, vocab] or None for one-hot (n-gram) drafts.
    Returns the accepted drafts followed by one token (a correction or the bonus)."""
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} target rows, got {target_probs.shape[0]}")
    uniforms = torch.rand(k, generator=generator, device=target_probs.device).tolist()
    out = []
    for i, token in enumerate(draft_tokens):
        p_row = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        p_token = float(p_row[token])
        if q_token > 0 and uniforms[i] * q_token < p_token:      # u < min(1, p / q)
            out.append(token)
            continue
        out.append(_draw(_residual(p_row, token, None if draft_probs is None
                                   else draft_probs[i]), generator))
        return out
    out.append(_draw(target_probs[k], generator))
    return out


def _residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """normalize(max(0, p - q)); q None is one-hot at `token`. Falls back to p when the
    residual has no mass (p == q, where a rejection cannot happen except by rounding)."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_(min=0.0)
    total = float(residual.sum())
    return residual / total if total > 0 else p


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class TypicalAcceptance:
    threshold: float = 0.09          # Medusa's posterior_threshold
    alpha: float = 0.3               # and posterior_alpha (its sqrt, in some of its scripts)


def verify_typical(target_probs: torch.Tensor, draft_tokens: list[int], rule: TypicalAcceptance,
                   generator: torch.Generator | None = None) -> list[int]:
    """target_probs [k+1, vocab]: the accepted drafts, then one token drawn from the target's
    distribution where the first draft fell below the bar (or the bonus row)."""
    k = len(draft_tokens)
    entropy = -(target_probs[:k] * target_probs[:k].clamp_min(1e-30).log()).sum(-1)
    bars = torch.clamp(rule.alpha * torch.exp(-entropy), max=rule.threshold).tolist()
    out = []
    for i, token in enumerate(draft_tokens):
        if float(target_probs[i, token]) <= bars[i]:
            break
        out.append(token)
    out.append(_draw(target_probs[len(out)], generator))
    return out
