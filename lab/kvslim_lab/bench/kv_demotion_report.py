"""`kvslim bench kv-demotion`'s files: kv_demotion.json (every number), kv_demotion.md (a table
and the goals per model) and kv_demotion.png (each mode's rate per model), written only from
the recorded result."""
from __future__ import annotations

from pathlib import Path

from kvslim_lab.bench.kv_demotion import MODES, KVDemotionResult, ModelDemotion
from kvslim_lab.bench.report_files import run_preamble, write_report_files

SPEEDUP_GOAL = 1.3        # demotion's throughput over preemption's, under 2x overload
PPL_TOLERANCE = 0.03      # its continuations' perplexity over the unpressured run's


def write_report(result: KVDemotionResult, out_dir: str | Path) -> list[Path]:
    return write_report_files(result, out_dir, "kv_demotion", plot, format_markdown)


def format_markdown(result: KVDemotionResult, image: str | None = None) -> str:
    c = result.config
    head = (f"# Demotion against preemption under overload\n\n" + run_preamble(result)
            + f"{c['requests']} requests at once, prompts of {c['prompt_tokens']} tokens of "
            f"{c['data']} and {c['max_tokens']} greedy tokens each, needing {c['overload']:g}x "
            f"the blocks the pool holds; each mode on the same KV bytes, {c['repeats']} runs "
            f"each in turn, a mode's rate the mean of its runs. Perplexity: the continuations "
            f"after their prompts, scored by the unpressured engine.\n\n"
            "| model | blocks: needed / pool | unpressured tok/s | preempt tok/s | demote tok/s "
            "| demote / preempt (per pair) | preemptions: preempt / demote | blocks demoted "
            "| ppl: unpressured / preempt / demote | demote's continuations equal to "
            "unpressured |\n" + "|---" * 10 + "|\n")
    rows = "".join(_row(md, c["requests"]) for md in result.models)
    lines = "".join(f"- {md.model}: {line}\n" for md in result.models for line in goals(md))
    return (head + rows + "\n" + lines
            + (f"\n![tokens/s per mode]({image})\n" if image else ""))


def _row(md: ModelDemotion, requests: int) -> str:
    pre, dem = md.runs["preempt"], md.runs["demote"]
    pairs = ", ".join(f"{d.tok_s / p.tok_s:.2f}" for d, p in zip(dem, pre))
    return (f"| {md.model} | {md.blocks_needed} / {md.blocks['preempt']} | "
            f"{md.unpressured.tok_s:.1f} | {md.rate('preempt'):.1f} | {md.rate('demote'):.1f} | "
            f"**{speedup(md):.3f}x** ({pairs}) | {pre[0].preemptions} / {dem[0].preemptions} | "
            f"{dem[0].demoted_blocks} | {md.unpressured.ppl:.3f} / {pre[0].ppl:.3f} / "
            f"{dem[0].ppl:.3f} | {dem[0].same_as_unpressured} of {requests} |\n")


def speedup(md: ModelDemotion) -> float:
    return md.rate("demote") / md.rate("preempt")


def goals(md: ModelDemotion) -> list[str]:
    """The issue's goals for this model, PASS or FAIL with the measured figures."""
    ratio = speedup(md)
    ppl = max(r.ppl for r in md.runs["demote"]) / md.unpressured.ppl - 1
    return [f"{'PASS' if ratio >= SPEEDUP_GOAL else 'FAIL'}: demotion's throughput "
            f"{ratio:.3f}x preemption's (goal >= {SPEEDUP_GOAL}x)",
            f"{'PASS' if ppl <= PPL_TOLERANCE else 'FAIL'}: the continuations' perplexity "
            f"under demotion {ppl:+.1%} against the unpressured run's (goal within "
            f"+{PPL_TOLERANCE:.0%})"]


def plot(result: KVDemotionResult, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8.5, 1.2 + 1.1 * len(result.models)))
    names = [md.model for md in result.models]
    for i, (label, colour) in enumerate((("unpressured", "tab:grey"), *zip(MODES, (
            "tab:red", "tab:green")))):
        rates = [md.unpressured.tok_s if label == "unpressured" else md.rate(label)
                 for md in result.models]
        ax.barh([j + 0.27 * (i - 1) for j in range(len(names))], rates, height=0.26,
                color=colour, label=label)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("output tokens/s (higher is better)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
