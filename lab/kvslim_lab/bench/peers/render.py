"""`kvslim bench peers`'s output from its JSON: a markdown table (every engine, skipped ones with
their reason), the ratios of kvslim's engines to the others from the same run, and a PNG."""
from __future__ import annotations

from pathlib import Path

COLORS = {"kvslim": "tab:blue", "llamacpp": "tab:orange", "vllm": "tab:green", "hf": "tab:gray"}


def _num(value, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


def markdown(d: dict) -> str:
    p = d["plan"]
    dec, off = p["decode"], p["offline"]
    bw = d["bandwidth"]
    lines = [f"Peers in one run ({d['started']}, {d['seconds'] / 60:.0f} min, {p['rounds']} "
             f"rounds, {d['threads']} threads; {d['machine'].get('cpu', '?')}, memory read "
             f"{bw.get('read_gb_s', '?')} GB/s). Batch-1 decode: {dec['input_len']}-token "
             f"prompt, {dec['output_len']} new tokens; offline: {off['num_prompts']} prompts x "
             f"{off['input_len']} in / {off['output_len']} out. Medians over the rounds.", "",
             "| engine | batch-1 tok/s | TPOT ms | offline output tok/s | best setting |",
             "|---|---|---|---|---|"]
    for e in d["engines"]:
        if e["status"] == "skipped":
            lines.append(f"| {e['label']} | skipped: {e['reason']} | | | |")
            continue
        lines.append(f"| {e['label']} | {_num(e['decode']['tokens_per_s'])} | "
                     f"{_num(e['decode']['tpot_ms'], '{:.2f}')} | "
                     f"{_num(e['offline']['output_tokens_per_s'])} | "
                     f"{e['offline']['best_setting'] or '—'} |")
    notes = [f"- {e['engine']}: {e['reason']}" for e in d["engines"]
             if e["status"] == "ran" and e["reason"]]
    ratios = _ratio_rows(d["ratios"])
    if ratios:
        lines += ["", "| kvslim / peer (same run) | batch-1 decode | offline |", "|---|---|---|"]
        lines += ratios
    return "\n".join(lines + serving_table(d)
                     + ([""] + notes if notes else [])) + "\n"


def serving_table(d: dict) -> list[str]:
    entries, plan = d.get("serving") or [], d["plan"].get("serving")
    if not entries:
        return []
    lines = ["", f"Serving, one server at a time: {plan['num_prompts']} requests arriving at "
                 f"{plan['request_rate']}/s (Poisson), {plan['input_len']} tokens in, "
                 f"{plan['output_len']} out, streamed.", "",
             "| server | TTFT p50 / p99 ms | TPOT p50 / p99 ms | output tok/s | completed |",
             "|---|---|---|---|---|"]
    for e in entries:
        if e["status"] != "ran":
            lines.append(f"| {e['label']} | skipped: {e['reason']} | | | |")
            continue
        lines.append(f"| {e['label']} | {e['ttft_ms']['p50']:.0f} / {e['ttft_ms']['p99']:.0f} | "
                     f"{e['tpot_ms']['p50']:.1f} / {e['tpot_ms']['p99']:.1f} | "
                     f"{e['output_tokens_per_s']:.1f} | {e['completed']} of "
                     f"{e['completed'] + e['failed']} |")
    return lines


def _ratio_rows(ratios: dict) -> list[str]:
    keys = list(dict.fromkeys([*ratios["decode"], *ratios["offline"]]))
    return [f"| {k} | {_num(ratios['decode'].get(k), '{:.2f}x')} | "
            f"{_num(ratios['offline'].get(k), '{:.2f}x')} |" for k in keys]


def plot(d: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ran = [e for e in d["engines"] if e["status"] == "ran"]
    names = [e["engine"] for e in ran]
    colors = [COLORS.get(n.split("-")[0], "tab:purple") for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.35 * len(ran) + 1.6), sharey=True)
    for ax, values, title in (
            (axes[0], [e["decode"]["tokens_per_s"] or 0 for e in ran], "batch-1 decode tok/s"),
            (axes[1], [e["offline"]["output_tokens_per_s"] or 0 for e in ran],
             "offline output tok/s")):
        ax.barh(names, values, color=colors)
        ax.set_title(f"{title} (higher is better)")
    axes[0].invert_yaxis()                           # the y axis is shared: inverted once
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
