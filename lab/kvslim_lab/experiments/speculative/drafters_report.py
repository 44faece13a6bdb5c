"""docs/speculative.md's section on learned drafters (Medusa heads, EAGLE heads): what each cost
to train and how often it guessed right on its training batch (its train_log.json, written by
`kvslim train-drafter`), then how often its drafts were accepted, by depth, on the study's
workloads, and what that bought at each batch size."""
from __future__ import annotations

import json
from pathlib import Path

from kvslim.train.drafter import LOG_FILE

LEARNED = ("medusa", "eagle")
TRAIN_HOURS_GOAL = 2.0


def learned_proposers(exp) -> list[tuple[str, str, dict]]:
    """(target name, proposer label, speculative config) of every learned drafter measured."""
    return [(t.name, label, spec) for t in exp.cfg.targets
            for label, spec in t.proposers.items() if spec["method"] in LEARNED]


def _train_logs(exp) -> dict[str, dict | None]:
    """drafter directory -> its train_log.json (None when it has none), each drafter once."""
    logs = {}
    for _, _, spec in learned_proposers(exp):
        path = Path(spec["model"]) / LOG_FILE
        if spec["model"] not in logs:
            logs[spec["model"]] = json.loads(path.read_text()) if path.is_file() else None
    return logs


def _per_head(value) -> str:
    if value is None:
        return "–"
    return " / ".join(f"{v:.2f}" for v in (value if isinstance(value, list) else [value]))


def _minutes(seconds: dict) -> str:
    parts = " / ".join(f"{seconds.get(k, 0) / 60:.1f}" for k in ("answers", "hidden_states",
                                                                  "steps"))
    return f"{seconds['total'] / 60:.1f} ({parts})"


def training_table(exp) -> str:
    lines = ["| drafter | kind | sequences | answer / text tokens | steps x positions | "
             "minutes: total (answers / hidden states / steps) | top-1 per head | "
             "top-5 per head |", "|---|---|---|---|---|---|---|---|"]
    for model, log in _train_logs(exp).items():
        if log is None:
            lines.append(f"| {model} | | no {LOG_FILE} | | | | | |")
            continue
        cfg, final = log["config"], log["final"]
        seconds = log.get("seconds")
        lines.append(
            f"| {model} | {cfg['kind']} | {log['sequences']} | {log['answer_tokens']:,} / "
            f"{log.get('text_tokens', 0):,} | {cfg['steps']} x {cfg['batch_positions']} | "
            f"{_minutes(seconds) if seconds else 'not recorded'} | "
            f"{_per_head(final.get('top1'))} | {_per_head(final.get('top5'))} |")
    return "\n".join(lines)


def training_goals(exp) -> list[tuple[str, bool, str]]:
    """The drafters' issue's budget: each trains in at most two hours on this machine."""
    checks = []
    for model, log in _train_logs(exp).items():
        if log and log.get("seconds"):
            minutes = log["seconds"]["total"] / 60
            checks.append((f"drafter {model} trains in <= {TRAIN_HOURS_GOAL:g} h on this machine",
                           minutes <= 60 * TRAIN_HOURS_GOAL, f"{minutes:.0f} min"))
    return checks


def acceptance_table(exp, table: dict) -> str:
    batches = exp.cfg.batch_sizes
    per_batch = " / ".join(map(str, batches))
    lines = ["| target | proposer | workload | acceptance by depth (batch 1) | tokens / "
             f"verification (batch 1) | speedup at batch {per_batch} | adaptive at batch "
             f"{per_batch} |", "|---|---|---|---|---|---|---|"]
    for target, label, _ in learned_proposers(exp):
        for w in ("free", "grounded"):
            first = table.get((target, label, w, batches[0], "spec"))
            if not first:
                continue
            speedups = [table.get((target, label, w, b, arm)) for arm in ("spec", "adaptive")
                        for b in batches]
            shown = [f"{c['speedup']:.2f}x" if c else "–" for c in speedups]
            depth = " / ".join(f"{a:.2f}" for a in first["acceptance_by_depth"]) or "–"
            tpv = first["tokens_per_verification"]
            lines.append(f"| {target} | {label} | {w} | {depth} | "
                         f"{'–' if tpv is None else f'{tpv:.2f}'} | "
                         f"{' / '.join(shown[:len(batches)])} | "
                         f"{' / '.join(shown[len(batches):])} |")
    return "\n".join(lines)


def drafters_section(exp, table: dict) -> str:
    """The section, or '' when the study measured no learned drafter."""
    if not learned_proposers(exp):
        return ""
    return f"""
## Learned drafters

How each drafter was trained (its `{LOG_FILE}`; the commands are in docs/drafters.md). Top-1 and
top-5 are on the last training batch, per head (an EAGLE head is one head drafting every
depth): what it learned, not what it will guess on new text. Answers or hidden states a run
found already made in its directory cost ~0 minutes there.

{training_table(exp)}

On the study's prompts (none of them training prompts): the share of verifications whose
drafts were accepted to each depth (depth 2 counts only where depth 1 was accepted too), the
tokens a verification step yielded (the mean accepted length, the target's own token
included), and the speedup over plain decoding, forced on (first phase) and adaptive.

{acceptance_table(exp, table)}
"""
