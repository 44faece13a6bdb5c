"""From the speculative experiment's runs: per-cell medians and speedups, and the adaptivity
thresholds each proposer gets measured, not guessed:

- `disable_by_batch_size`: the largest batch size measured at which speculation still won on
  every workload (1 when there is none: then only the per-sequence back-off decides);
- `backoff_acceptance`: the acceptance per draft token at which a verification step yields as
  many tokens as it costs plain steps, from the step times measured at batch 1."""
from __future__ import annotations

import statistics
from collections import defaultdict

from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim_lab.experiments.speculative.records import Run, Target
from kvslim_lab.experiments.speculative.workloads import WORKLOADS


def cells(runs: list[Run]) -> dict[tuple, dict]:
    """(target, proposer, workload, batch, arm) -> median tokens/s, speedup over plain decoding
    in the same phase and repeat, acceptance, tokens per verification, whether outputs
    matched, median seconds per engine step."""
    groups: dict[tuple, list[Run]] = defaultdict(list)
    plain = {}
    for r in runs:
        groups[(r.target, r.proposer, r.workload, r.batch, r.arm)].append(r)
        if r.arm == "plain":
            plain[(r.target, r.workload, r.batch, r.phase, r.repeat)] = r
    out = {}
    for key, group in groups.items():
        speedups = [r.tokens_per_s / plain[p].tokens_per_s for r in group
                    if (p := (r.target, r.workload, r.batch, r.phase, r.repeat)) in plain]
        drafts = sum(r.draft_tokens for r in group)
        accepted = sum(r.accepted_tokens for r in group)
        verifications = sum(r.verifications for r in group)
        steps = [r.seconds / r.steps for r in group if r.steps]
        out[key] = dict(
            tokens_per_s=statistics.median(r.tokens_per_s for r in group),
            speedup=statistics.median(speedups), speedup_min=min(speedups),
            speedup_max=max(speedups),
            acceptance=accepted / drafts if drafts else None,
            tokens_per_verification=1 + accepted / verifications if verifications else None,
            acceptance_by_depth=_acceptance_by_depth(group),
            identical=all(r.identical for r in group),
            seconds_per_step=statistics.median(steps) if steps else None)
    return out


def _acceptance_by_depth(group: list[Run]) -> list[float]:
    """Per draft depth: the share of verifications drafting that deep that were accepted to
    it (so depth 2 counts only where depth 1 was accepted too)."""
    depth = max((len(r.drafted_per_depth) for r in group), default=0)
    drafted, accepted = [0] * depth, [0] * depth
    for r in group:
        for i, (d, a) in enumerate(zip(r.drafted_per_depth, r.accepted_per_depth)):
            drafted[i] += d
            accepted[i] += a
    return [a / d for a, d in zip(accepted, drafted) if d]


def break_even_acceptance(cost_ratio: float, k: int) -> float | None:
    """Per-token acceptance a at which a verification step yields `cost_ratio` tokens, with
    independent acceptances: 1 + a + ... + a^k = cost_ratio. None if unreachable (> k + 1)."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(k + 1)) < cost_ratio:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def adaptive_settings(runs: list[Run], batch_sizes: list[int], target: Target
                      ) -> dict[str, dict]:
    """Per proposer of `target`: the thresholds measured in phase 1's runs and the settings
    they give."""
    table = cells([r for r in runs if r.target == target.name and r.phase == 1])
    out = {}
    for label, spec in target.proposers.items():
        # the depth a verification drafts (a tree's depth, not its nodes), as the engine does
        k = SpeculativeConfig(**spec).num_speculative_tokens
        wins = [b for b in sorted(batch_sizes)
                if all(table.get((target.name, label, w, b, "spec"), {}).get("speedup", 0) >= 1
                       for w in WORKLOADS)]
        ratios = [table[(target.name, label, w, 1, "spec")]["seconds_per_step"]
                  / table[(target.name, "plain", w, 1, "plain")]["seconds_per_step"]
                  for w in WORKLOADS if (target.name, label, w, 1, "spec") in table]
        cost = statistics.median(ratios) if ratios else None
        even = None if cost is None else break_even_acceptance(cost, k)
        out[label] = dict(
            k=k, largest_winning_batch=max(wins) if wins else None, step_cost_ratio=cost,
            break_even_acceptance=even,
            settings={"disable_by_batch_size": max(wins) if wins else 1,
                      "backoff_acceptance": 1.0 if even is None and cost is not None
                      else round(even or 0.0, 3)})
    return out
