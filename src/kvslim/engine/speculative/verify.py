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


def typical_acceptance_of(spec) -> TypicalAcceptance | None:
    """The rule a SpeculativeConfig asks for: typical acceptance, or None for the exact one."""
    if spec is None or spec.acceptance != "typical":
        return None
    return TypicalAcceptance(spec.typical_threshold, spec.typical_alpha)


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


# ---- a tree of drafts --------------------------------------------------------------------
# At each row of the path walked so far, the target picks the next token among the row's
# children (their drafts, one-hot, in the proposer's order of preference); the walk goes on
# into the child whose draft it picked, and ends at a row where it picked none of them.
# Children: (row, draft token) pairs.

def pick_greedy(logits_row: torch.Tensor, children: list[tuple[int, int]]
                ) -> tuple[int, int | None]:
    """The target's argmax, and the child that drafted it (None: no child did)."""
    token = int(logits_row.argmax())
    return token, next((row for row, draft in children if draft == token), None)


def pick_sampled(probs_row: torch.Tensor, children: list[tuple[int, int]],
                 generator: torch.Generator | None = None) -> tuple[int, int | None]:
    """Exact: each child's draft in turn is kept with the probability the target's remaining
    distribution gives it, and removed from that distribution when rejected; after the last,
    a draw from what remains. Draft i is emitted with probability p_i (rejected drafts before
    it leave p_i / (1 - theirs) to a draw that happens with probability 1 - theirs), and every
    other token with its p: the target's distribution (SpecInfer's multi-draft rule for
    one-hot drafts)."""
    p = probs_row.clone()
    for row, draft in children:
        total = float(p.sum())
        if total <= 0:
            break
        if float(torch.rand(1, generator=generator, device=p.device)) * total < float(p[draft]):
            return draft, row
        p[draft] = 0.0
    if float(p.sum()) <= 0:          # rounding left no mass: the target's own distribution
        p = probs_row
    return _draw(p / p.sum(), generator), None


def pick_typical(probs_row: torch.Tensor, children: list[tuple[int, int]],
                 rule: TypicalAcceptance, generator: torch.Generator | None = None
                 ) -> tuple[int, int | None]:
    """Not exact: the first child whose draft clears the typical bar (as verify_typical),
    else a draw from the target's distribution."""
    entropy = -(probs_row * probs_row.clamp_min(1e-30).log()).sum()
    bar = min(rule.threshold, rule.alpha * float(torch.exp(-entropy)))
    for row, draft in children:
        if float(probs_row[draft]) > bar:
            return draft, row
    return _draw(probs_row, generator), None
