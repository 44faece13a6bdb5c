"""The goals of `kvslim experiment gqa`, each checked against the recorded runs: a line says
PASS or FAIL with the numbers it was decided on, and a goal whose runs are missing is not
claimed either way."""
from __future__ import annotations

from kvslim_lab.experiments.gqa.mla_arms import is_mla
from kvslim_lab.experiments.gqa.study import Experiment, RunResult

METHOD_ORDER = ["mean", "first", "random", "align", "align-kd", "align-nu", "align-nu-kd", "mla",
                "mla-kd", "mla-mha2mla"]
SMOLLM2_TOKEN_BUDGET = 2_000_000
# SmolLM2's goals by the share of its KV bytes kept: within 10% of the original's perplexity at
# one third (GQA: MQA), within 15% at a quarter (MLA)
SMOLLM2_GOALS = {3: ("one third", 0.10), 4: ("a quarter", 0.15)}
SMOLLM2_GOAL = SMOLLM2_GOALS[3][1]


def ref_index(results) -> dict[tuple[float, str, float], RunResult]:
    return {(r.kv_heads, r.method, r.alpha): r for r in results.values() if r.model == "ref"}


def goal_checks(exp: Experiment) -> list[tuple[str, bool, str]]:
    return (_quality_goals(exp) + _nonuniform_goals(exp) + _mla_goals(exp)
            + _decode_goals(exp) + _smollm2_goals(exp) + _ranking_checks(exp))


def bytes_name(k: float) -> str:
    return "MQA" if k == 1 else f"GQA-{k:g}"


def _quality_goals(exp: Experiment) -> list[tuple[str, bool, str]]:
    """GQA-(H/2) within 1% and GQA-(H/4) within 2% of the control after alpha = 0.05."""
    idx, h = ref_index(exp.results), exp.config.num_attention_heads
    ctrl = idx.get((h, "mha", 0.05))
    checks = []
    for k, goal in ((h // 2, 0.01), (h // 4, 0.02)):
        for method in ("mean", "align", "align-kd", "align-nu", "align-nu-kd"):
            r = idx.get((k, method, 0.05))
            if r and ctrl:
                delta = (r.test_ppl - ctrl.test_ppl) / ctrl.test_ppl
                checks.append((f"GQA-{k} ({method}) after alpha = 0.05 within {goal:.0%} of the "
                               f"MHA control", delta <= goal,
                               f"{r.test_ppl:.3f} vs {ctrl.test_ppl:.3f} ({delta:+.2%})"))
    return checks


def _nonuniform_goals(exp: Experiment) -> list[tuple[str, bool, str]]:
    idx = ref_index(exp.results)
    checks = []
    for k in sorted({k for k, m, _ in idx if m == "align-nu"}, reverse=True):
        nu, uni = idx.get((k, "align-nu", 0.0)), idx.get((k, "align", 0.0))
        # at one head per layer the budget allows only the uniform allocation: nothing to check
        if nu and uni and nu.kv_heads_per_layer:
            checks.append(_beats(f"non-uniform beats uniform at the KV bytes of K={k:g}, "
                                 f"alpha = 0 (align-nu vs align)", nu, uni))
    return checks


def _beats(text: str, a: RunResult, b: RunResult) -> tuple[str, bool, str]:
    """The goal `text`: `a` has the lower perplexity (both models' KV bytes beside)."""
    return (text, a.test_ppl < b.test_ppl,
            f"{a.test_ppl:.3f} vs {b.test_ppl:.3f}, {a.kv_bytes_per_token_bf16:,} vs "
            f"{b.kv_bytes_per_token_bf16:,} bytes/token")


def _mla_goals(exp: Experiment) -> list[tuple[str, bool, str]]:
    """MLA at a GQA arm's KV bytes against that arm after alpha = 0.05, each with the same
    recipe: plain uptraining against align's, distilled against align-kd's."""
    idx = ref_index(exp.results)
    checks = []
    for k in sorted({k for k, m, _ in idx if is_mla(m)}, reverse=True):
        for mla, gqa in (("mla", "align"), ("mla-kd", "align-kd")):
            a, b = idx.get((k, mla, 0.05)), idx.get((k, gqa, 0.05))
            if a and b:
                checks.append(_beats(f"MLA at {bytes_name(k)}'s KV bytes beats {bytes_name(k)} "
                                     f"({gqa}) after alpha = 0.05 ({mla})", a, b))
    return checks


def _decode_goals(exp: Experiment) -> list[tuple[str, bool, str]]:
    checks = []
    for d in sorted(exp.decode.values(), key=lambda d: (-d.kv_heads, d.batch)):
        mla, gqa, mla_g, gqa_g = (d.tokens_per_s.get(a)
                                  for a in ("mla", "gqa", "mla-gather", "gqa-gather"))
        if mla and gqa:
            name = bytes_name(d.kv_heads)
            # both on the other backend: whether a gap is the backend or the arithmetic
            same = (f"; on the gather backend {mla_g:.1f} vs {gqa_g:.1f}" if mla_g and gqa_g
                    else "")
            checks.append((f"MLA decode (absorbed matrices) no slower than {name} at equal KV "
                           f"bytes, batch {d.batch}", mla >= gqa,
                           f"{mla:.1f} vs {gqa:.1f} tokens/s ({mla / gqa:.2f}x){same}"))
    return checks


def smollm2_tokens(exp: Experiment, r: RunResult) -> int:
    return r.uptrain_steps * exp.cfg.smollm2_batch_size * exp.cfg.seq_len


def _smollm2_goals(exp: Experiment) -> list[tuple[str, bool, str]]:
    return [c for share in SMOLLM2_GOALS for c in _smollm2_goal(exp, share)]


def _smollm2_goal(exp: Experiment, share: int) -> list[tuple[str, bool, str]]:
    """The best arm with 1/share of the original's KV bytes, and what it would take to spend the
    whole token budget when the runs used less."""
    label, goal = SMOLLM2_GOALS[share]
    runs = [r for r in exp.results.values() if r.model == "smollm2"]
    orig = next((r for r in runs if r.method == "original"), None)
    arms = [r for r in runs if r.method != "original" and orig
            and share * r.kv_bytes_per_token_bf16 == orig.kv_bytes_per_token_bf16
            and smollm2_tokens(exp, r) <= SMOLLM2_TOKEN_BUDGET]
    if not (orig and arms):
        return []
    best = min(arms, key=lambda r: r.test_ppl)
    delta = (best.test_ppl - orig.test_ppl) / orig.test_ppl
    longest = max(arms, key=lambda r: smollm2_tokens(exp, r))
    if not smollm2_tokens(exp, longest):     # none uptrained: the rate of SmolLM2's other runs
        longest = max(runs, key=lambda r: smollm2_tokens(exp, r))
    most = smollm2_tokens(exp, longest)
    detail = (f"best {best.test_ppl:.3f} ({best.method}, {smollm2_tokens(exp, best):,} tokens) vs "
              f"{orig.test_ppl:.3f} ({delta:+.1%}); the longest run measured used {most:,} tokens"
              f"{'' if longest in arms else f' ({longest.method}, another arm)'}")
    if most < SMOLLM2_TOKEN_BUDGET and most:
        # the logged training rate; without it the whole run's (with conversion and scoring)
        rate = longest.train_tokens_per_s or most / longest.seconds
        detail += (f" — at its {rate:.0f} tokens/s the whole budget would take "
                   f"{SMOLLM2_TOKEN_BUDGET / rate / 3600:.0f} h on this machine")
    return [(f"SmolLM2 with {label} of its KV bytes within {goal:.0%} of its original "
             f"perplexity after at most {SMOLLM2_TOKEN_BUDGET / 1e6:g}M uptraining tokens",
             delta <= goal, detail)]


def _ranking_checks(exp: Experiment) -> list[tuple[str, bool, str]]:
    """The first round's orderings: MQA below GQA, mean > first > random, align >= mean."""
    idx, h = ref_index(exp.results), exp.config.num_attention_heads
    ks = sorted({k for k, m, _ in idx if m != "mha"}, reverse=True)

    def ppl(k, m, a):
        r = idx.get((k, m, a))
        return r.test_ppl if r else None

    checks = []
    for method in [m for m in METHOD_ORDER if not is_mla(m)]:
        pairs = [(ppl(1, method, a), ppl(h // 4, method, a)) for a in exp.all_alphas]
        pairs = [(m, g) for m, g in pairs if m and g]
        if pairs:
            checks.append((f"MQA worse than GQA-{h // 4} ({method}, every alpha)",
                           all(m > g for m, g in pairs),
                           ", ".join(f"{m:.2f} vs {g:.2f}" for m, g in pairs)))
    for k in ks:
        vals = [ppl(k, m, 0.0) for m in ("mean", "first", "random")]
        if all(vals):
            checks.append((f"K={k}: mean better than first better than random at alpha = 0",
                           vals[0] < vals[1] < vals[2], " / ".join(f"{v:.2f}" for v in vals)))
    for k in ks:
        a, m = ppl(k, "align", 0.0), ppl(k, "mean", 0.0)
        if a and m:
            checks.append((f"K={k}: align beats mean pooling at alpha = 0", a < m,
                           f"{a:.2f} vs {m:.2f}"))
    for alpha in [a for a in exp.all_alphas if a > 0]:
        for k in ks:
            a, m = ppl(k, "align", alpha), ppl(k, "mean", alpha)
            if a and m:
                checks.append((f"K={k}: align does not lose to mean after alpha = {alpha:g}",
                               a <= m * 1.001, f"{a:.3f} vs {m:.3f}"))
    return checks
