"""`kvslim bench kv-budget`'s files: kv_budget.json (every number), kv_budget.md (a table and
the goals per model) and kv_budget.png (KL and perplexity per setting), written only from the
recorded result."""
from __future__ import annotations

from pathlib import Path

from kvslim_lab.bench.kv_budget import Candidate, KVBudgetResult, ModelBudget
from kvslim_lab.bench.report_files import run_preamble, write_report_files

DASH = "–"
KL_TOLERANCE = 0.20        # the goal: the plan's predicted KL within 20% of the measured


def write_report(result: KVBudgetResult, out_dir: str | Path) -> list[Path]:
    return write_report_files(result, out_dir, "kv_budget", plot, format_markdown)


def format_markdown(result: KVBudgetResult, image: str | None = None) -> str:
    c = result.config
    head = (f"# The KV budget compiler against uniform settings\n\n" + run_preamble(result)
            + f"Budget: {c['fraction']:g} of int8's bytes for a sequence of {c['context']} tokens "
            f"(sinks {c['sinks']}, blocks of {c['block_size']}). KL predicted: the plan's "
            f"layers' calibration KL, each layer alone, summed (what the compiler minimises); "
            f"in brackets, all its layers at once on the calibration text. KL measured: mean "
            f"next-token KL against the exact model on {c['kl_batches']} held-out windows of "
            f"{c['context']} tokens ({c['data']}); perplexity read back through the engine's "
            f"cache ({c['ppl_tokens']} tokens in windows of {c['ppl_window'] or c['context']}, "
            f"chunks of "
            f"{c['chunk']}); capacity (the engine's max_tokens) in the memory of "
            f"{c['concurrency']} sequences of each setting.\n")
    body = "".join(_model_section(mb, c) for mb in result.models)
    return head + body + (f"\n![KL and perplexity per setting]({image})\n" if image else "")


def _model_section(mb: ModelBudget, c: dict) -> str:
    contexts = c["passkey_contexts"]
    rows = ["| setting | bytes / sequence | KL predicted | KL measured | perplexity (cache) "
            "| " + " | ".join(f"passkey {n}" for n in contexts) + " | max_tokens |",
            "|---" * (6 + len(contexts)) + "|"]
    rows += [_row(cand, contexts) for cand in mb.candidates]
    plan = next(cand for cand in mb.candidates if cand.name == "plan")
    layers = ", ".join(f"{l['precision']}" + (f"+w{l['window']}" if l["window"] else "")
                       for l in plan.layers)
    return (f"\n## {mb.model}\n\nBudget {mb.budget_per_sequence:,} bytes a sequence (int8: "
            f"{mb.int8_per_sequence:,}); measured in {mb.seconds:.0f} s.\n\n" + "\n".join(rows)
            + f"\n\nThe plan, layer by layer: {layers}\n\n" + "".join(
                f"- {line}\n" for line in goals(mb)))


def _row(c: Candidate, contexts: list[int]) -> str:
    e = c.engine or {}
    keys = {p["context"]: p for p in e.get("passkey", [])}
    cells = [_passkey(keys.get(n)) for n in contexts]
    ppl = e.get("perplexity")
    name = c.name if c.rival or c.name == "plan" else f"{c.name} (reference, over budget)"
    predicted = _num(c.predicted_kl) + (f" ({_num(c.calibration_kl)})"
                                        if c.calibration_kl is not None else "")
    return (f"| {name} | {c.bytes_per_sequence:,} | {predicted} | "
            f"{_num(c.measured_kl)} | {_num(ppl, 3) if ppl else (e.get('error') or DASH)} | "
            + " | ".join(cells) + f" | {e.get('max_tokens') or DASH} |")


def _passkey(p: dict | None) -> str:
    if not p:
        return DASH
    return p["skipped"] if p.get("skipped") else f"{p['passes']}/{p['cases']}"


def _num(x, digits: int = 4) -> str:
    return DASH if x is None else f"{x:.{digits}g}"


def goals(mb: ModelBudget) -> list[str]:
    """The issue's quality goals for this model, PASS or FAIL with the measured figures."""
    plan = next(c for c in mb.candidates if c.name == "plan")
    rivals = [c for c in mb.candidates if c.rival and c.name != "plan"]
    worse_kl = [c.name for c in rivals if c.measured_kl <= plan.measured_kl]
    ppl = {c.name: (c.engine or {}).get("perplexity") for c in [plan, *rivals]}
    worse_ppl = [n for n in ppl if n != "plan" and ppl[n] and ppl["plan"]
                 and ppl[n] <= ppl["plan"]]
    gap = abs(plan.predicted_kl - plan.measured_kl) / max(plan.measured_kl, 1e-12)
    return [
        f"{'PASS' if not worse_kl else 'FAIL'}: the plan's KL ({plan.measured_kl:.4g}) below "
        f"every uniform setting of the same bytes" + (f" (not below {', '.join(worse_kl)})"
                                                      if worse_kl else ""),
        f"{'PASS' if ppl['plan'] and not worse_ppl else 'FAIL'}: the plan's perplexity "
        f"through the cache ({_num(ppl['plan'], 5)}) below every uniform setting's"
        + (f" (not below {', '.join(worse_ppl)})" if worse_ppl else ""),
        f"{'PASS' if gap <= KL_TOLERANCE else 'FAIL'}: predicted KL {plan.predicted_kl:.4g} "
        f"(calibration, layers summed) within {KL_TOLERANCE:.0%} of the measured "
        f"{plan.measured_kl:.4g} (held-out, all layers at once): off by {gap:.0%}"]


def plot(result: KVBudgetResult, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(result.models), 2, figsize=(11, 3.2 * len(result.models)),
                             squeeze=False)
    for (ax_kl, ax_ppl), mb in zip(axes, result.models):
        names = [c.name for c in mb.candidates]
        colours = ["tab:green" if n == "plan" else "tab:grey" if n == "exact" else "tab:blue"
                   for n in names]
        ax_kl.barh(names, [c.measured_kl or 0 for c in mb.candidates], color=colours)
        ax_kl.set_xscale("symlog", linthresh=1e-3)
        ax_kl.set_title(f"{mb.model}: held-out KL (lower is better)")
        ppl = [(c.engine or {}).get("perplexity") or 0 for c in mb.candidates]
        ax_ppl.barh(names, ppl, color=colours)
        ax_ppl.set_title("perplexity through the cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
