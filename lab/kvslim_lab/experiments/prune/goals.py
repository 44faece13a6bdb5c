"""The pruning goals, checked against the recorded numbers of `kvslim experiment prune`: PASS or
FAIL when both sides were measured, NOT MEASURED (with why) when one was not."""
from __future__ import annotations

from kvslim_lab.experiments.prune.arms import DENSE, arm_name, target_label
from kvslim_lab.experiments.quant.goals import FAIL, NOT_MEASURED, PASS, Goal


def numbers(exp, model: str, arm: str) -> dict | None:
    r = exp.results.get(f"{model}/{arm}")
    return r.numbers if r is not None and r.status == "done" else None


def ppl(exp, model: str, arm: str) -> float | None:
    n = numbers(exp, model, arm)
    return None if n is None else n.get("ppl")


def goals(exp) -> list[Goal]:
    out = [_ordering(exp, m) for m in exp.model_keys()]
    if "ref-mha" in exp.model_keys():
        out.append(_recovered(exp, "ref-mha"))
    out += [_size(exp, m) for m in exp.model_keys()]
    return out


def _ordering(exp, model: str) -> Goal:
    text = "SparseGPT beats Wanda, and Wanda magnitude, at every sparsity"
    broken, seen = [], 0
    for t in exp.cfg.targets:
        p = [ppl(exp, model, arm_name(m, t, None)) for m in ("sparsegpt", "wanda", "magnitude")]
        if None in p:
            continue
        seen += 1
        if not p[0] < p[1] < p[2]:
            broken.append(f"{target_label(t)}: {p[0]:.3f} / {p[1]:.3f} / {p[2]:.3f}")
    if not seen:
        return Goal(model, text, NOT_MEASURED, "no target measured with all three methods")
    if broken:
        return Goal(model, text, FAIL, "SparseGPT / Wanda / magnitude at " + "; ".join(broken))
    return Goal(model, text, PASS, f"at all {seen} targets")


def _recovered(exp, model: str) -> Goal:
    text = "50% SparseGPT within 15% of the dense perplexity after ≤ 0.5M recovery tokens"
    dense, name = ppl(exp, model, DENSE), arm_name("sparsegpt", "0.5", None)
    before, after = ppl(exp, model, name), ppl(exp, model, f"{name}+rec")
    if dense is None or before is None:
        return Goal(model, text, NOT_MEASURED, "dense or 50% SparseGPT not measured")
    tokens = exp.cfg.recovery_tokens
    best = after if after is not None and tokens <= 500_000 else before
    detail = (f"{best:.2f} vs dense {dense:.2f} ({best / dense - 1:+.2%}); before recovery "
              f"{before:.2f} ({before / dense - 1:+.2%})"
              + ("" if after is None else f", after {tokens:,} tokens {after:.2f}"))
    return Goal(model, text, PASS if best <= 1.15 * dense else FAIL, detail)


def _size(exp, model: str) -> Goal:
    text = "2:4 + 4-bit linears ≤ 1/6 of their bf16 bytes on disk"
    dense = numbers(exp, model, DENSE)
    quant = numbers(exp, model, arm_name("sparsegpt", "2:4", exp.cfg.bits))
    if dense is None or quant is None:
        return Goal(model, text, NOT_MEASURED, "dense or SparseGPT 2:4 + 4-bit not measured")
    ratio = dense["linear_bf16_bytes"] / quant["linear_bytes"]
    return Goal(model, text, PASS if ratio >= 6 else FAIL,
                f"1/{ratio:.2f}: {quant['linear_bytes'] / 1e6:.2f} MB against "
                f"{dense['linear_bf16_bytes'] / 1e6:.2f} MB (GPTQ layout: every weight keeps "
                "its 4-bit code, the zeros included)")
