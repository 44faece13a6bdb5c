"""`kvslim bench kv-quality`'s files: kv_quality.json (every number and the settings),
kv_quality.md (one table per model) and kv_quality.png (perplexity and capacity per setting),
written only from the recorded result."""
from __future__ import annotations

from pathlib import Path

from kvslim_lab.bench.kv_quality import KVQualityResult, ModelResult, SettingResult
from kvslim_lab.bench.report_files import write_report_files

DASH = "–"


def write_report(result: KVQualityResult, out_dir: str | Path) -> list[Path]:
    return write_report_files(result, out_dir, "kv_quality", plot, format_markdown)


def format_markdown(result: KVQualityResult, image: str | None = None) -> str:
    text = _header(result) + "".join(_model_section(result, m) for m in result.models)
    return text + (f"![perplexity and capacity per KV-cache setting]({image})\n" if image else "")


def _header(result: KVQualityResult) -> str:
    c, m = result.config, result.machine
    speed = (f"decode tokens/s at batch {', '.join(map(str, c['speed_batches']))} "
             f"({c['speed_tokens']} new tokens after 32-token prompts, an engine of its own)"
             if c["speed_batches"] else "decode speed not measured")
    machine = (f"Machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')} with "
               f"{m.get('torch_threads')} threads. " if m else "")
    command = f"```bash\n{result.command}\n```\n\n" if result.command else ""
    return f"""# KV-cache settings: capacity and quality

{command}{machine}{"Date: " + result.date if result.date else ""}

- **Capacity** (the engine's `KVCachePlan`): KV bytes per token (all layers, scales included)
  and the sequences of {c['context']} tokens that fit at once in {c['kv_cache_memory']}.
- **Perplexity**: `{c['data']}`, first {c['max_tokens']} tokens, windows of {c['window']}
  side by side, scored with prompt logprobs through the engine, prefilled in chunks of
  {c['chunk']} tokens so every chunk attends to what the cache stored; "vs float" is against
  the float cache. The dense pass (no cache) scores the same tokens.
- **Passkey**: a random 5-digit key at depths {', '.join(map(str, c['passkey_depths']))} of
  filler text, {c['passkey_tokens']} greedy tokens; passes/cases per context.
- **Speed**: {speed}.

"""


def _model_section(result: KVQualityResult, m: ModelResult) -> str:
    c = result.config
    contexts = c["passkey_contexts"]
    batches = c["speed_batches"]
    head = (["setting", "KV dtype", "KV B/token", f"seqs of {c['context']}", "perplexity",
             "vs float"] + [f"passkey {n}" for n in contexts]
            + [f"tok/s b={b}" for b in batches])
    lines = [f"## {m.model}\n", f"Dense perplexity (no cache): {_num(m.dense_perplexity)}\n"
             if m.dense_perplexity else "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    notes = []
    for s in m.settings:
        lines.append("| " + " | ".join(_row(s, contexts, batches, notes)) + " |")
    return "\n".join(lines) + "\n\n" + "".join(f"- {n}\n" for n in notes) + ("\n" if notes
                                                                              else "")


def _row(s: SettingResult, contexts: list[int], batches: list[int], notes: list[str]
         ) -> list[str]:
    width = 5 + len(contexts) + len(batches)
    if s.kv_bytes_per_token is None:       # never ran: the reason in the row, the rest empty
        return [f"`{s.setting}`", s.error or DASH] + [DASH] * (width - 1)
    if s.error:
        notes.append(f"`{s.setting}`: {s.error}")
    scores = {p.context: p for p in s.passkey}
    cells = [f"`{s.setting}`", s.kv_cache_dtype or DASH, str(s.kv_bytes_per_token),
             str(s.sequences), _num(s.perplexity),
             DASH if s.vs_float_pct is None else f"{s.vs_float_pct:+.2f}%"]
    for n in contexts:
        cells.append(_passkey_cell(s, scores.get(n), notes))
    cells += [_num(s.decode_tok_s.get(str(b)), 1) for b in batches]
    return cells


def _passkey_cell(s: SettingResult, p, notes: list[str]) -> str:
    if p is None:
        return DASH
    if p.skipped:
        notes.append(f"`{s.setting}`, passkey {p.context}: skipped, {p.skipped}")
        return "skipped"
    return f"{p.passes}/{p.cases}"


def _num(x, digits: int = 3) -> str:
    return DASH if x is None else f"{x:.{digits}f}"


def plot(result: KVQualityResult, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = max(1, len(result.models))
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.4 * rows), squeeze=False)
    for (ax_ppl, ax_fit), m in zip(axes, result.models):
        ran = [s for s in m.settings if s.kv_bytes_per_token is not None]
        names = [s.setting for s in ran]
        # The change against the float cache, labelled with the perplexity itself: bars of
        # the perplexities would hide a 1% change.
        bars = ax_ppl.bar(names, [s.vs_float_pct or 0 for s in ran], color="tab:blue")
        ax_ppl.bar_label(bars, [_num(s.perplexity, 2) for s in ran], fontsize=8)
        ax_ppl.axhline(0, color="k", lw=0.8)
        ax_ppl.set_ylabel("perplexity vs float cache, %")
        ax_ppl.set_title(f"{m.model}: perplexity (lower is better)")
        ax_fit.bar(names, [s.sequences or 0 for s in ran], color="tab:purple")
        ax_fit.set_title(f"sequences of {result.config['context']} tokens in "
                         f"{result.config['kv_cache_memory']}")
        for ax in (ax_ppl, ax_fit):
            ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
