"""The report of `kvslim experiment quant`: docs/quantization.md, its JSON (every number, the
settings and the machine) and a plot of perplexity against weight bytes, written only from the
recorded results."""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from kvslim_lab.experiments.quant.study import QuantExperiment
from kvslim_lab.experiments.quant.goals import model_goals

MB = 1e6


def goals(exp: QuantExperiment) -> list:
    return [g for m in exp.model_keys() for g in model_goals(exp.results, m, exp.cfg.group_sizes)]


def report_data(exp: QuantExperiment, command: str, machine: dict) -> dict:
    return {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine, "settings": asdict(exp.cfg),
            "arms": {k: asdict(v) for k, v in exp.results.items()
                     if v.model in exp.model_keys()},
            "goals": [asdict(g) for g in goals(exp)]}


def write_report(exp: QuantExperiment, command: str, machine: dict) -> Path:
    report = Path(exp.cfg.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    data = report_data(exp, command, machine)
    image = plot(exp, report.with_suffix(".png"))
    text = (_header(exp, data) + "".join(_model_section(exp, m) for m in exp.model_keys())
            + f"![perplexity vs weight bytes]({image.name})\n\n" + _goals_section(exp)
            + _notes(exp))
    report.write_text(text)
    report.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    return report


def _arms(exp: QuantExperiment, model: str) -> list:
    order = {a.name: i for i, a in enumerate(exp.arms)}
    return sorted((r for r in exp.results.values() if r.model == model and r.arm in order),
                  key=lambda r: order[r.arm])


def _header(exp: QuantExperiment, data: dict) -> str:
    cfg, m, w = exp.cfg, data["machine"], exp.cfg.workload()
    ppl_tokens = f", first {cfg.ppl_max_tokens:,} tokens" if cfg.ppl_max_tokens else ""
    return f"""# Quantization: measured results

Every number on this page was produced by one command (it resumes: finished arms are recorded in
`{cfg.work_dir}/results.json` and skipped by a rerun; all numbers are in
[{Path(cfg.report).with_suffix('.json').name}]({Path(cfg.report).with_suffix('.json').name})):

```bash
{data["command"]}
```

Machine: {m.get("cpu")}, {m.get("cores")} cores, {m.get("memory_gib")} GiB, torch
{m.get("torch")} with {m.get("torch_threads")} threads (llama.cpp: the same `-t`), Python
{m.get("python")}. Date: {data["date"]}. Methods and checkpoint layouts:
[quantization-formats.md](quantization-formats.md).

**Every cell is a single run** (batch-1 decode: the median of {cfg.decode_repeats} repeats) on a
shared CPU: speeds move by 5-15% from run to run here, so a ratio within about 10% of a goal is
a tie, not a verdict. Perplexity is deterministic.

- **Perplexity** (`kvslim ppl`): `{cfg.test}`, windows of {cfg.ppl_context} tokens, stride
  {cfg.ppl_stride}{ppl_tokens}, on the loaded weights (quantized layers dequantized). The int8
  KV cache's is measured through the engine (prompt logprobs, the same windows), beside the
  float cache's on the same path.
- **Calibration** (GPTQ, AWQ): `{cfg.calib}`, {cfg.calib_samples} windows of {cfg.calib_seq_len}
  tokens; {"symmetric" if cfg.sym else "asymmetric"} grids.
- **Weight bytes**: the stored tensors (safetensors headers; a GGUF file's tensor table), the
  tied LM head once; "linears" is the decoder's linear layers alone. **KV bytes/token**: the
  engine's cache (float32 on CPU; int8 with its float16 scales).
- **Batch-1 decode** (`kvslim bench latency --batches 1`): {cfg.decode_input_len}-token prompt,
  {cfg.decode_output_len} generated; llama.cpp: `llama-bench -p 0 -d {cfg.decode_input_len} -n
  {cfg.decode_output_len}`.
- **Offline throughput** (`kvslim bench throughput`): {w.num_prompts} prompts x {w.input_len}
  tokens in / {w.output_len} out, output tokens/s (prefill included); llama.cpp:
  `llama-batched-bench -npp {w.input_len} -ntg {w.output_len}`, the best `-npl` of
  {cfg.llamacpp_parallel}; HF transformers: static batches, the best of {cfg.hf_batch_sizes}.

"""


def _num(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def _rel(v, base) -> str:
    return "" if v is None or not base else f" ({v / base:.2f}x)"


def _model_section(exp: QuantExperiment, model: str) -> str:
    arms = _arms(exp, model)
    base = next((r.numbers for r in arms if r.arm == "float32" and r.status == "done"), {})
    f32_peer = next((r.numbers.get("ppl") for r in arms
                     if r.arm == "llamacpp-f32" and r.status == "done"), None)
    rows = ["| mode | engine | test ppl | vs float32 | weight MB | linears MB | KV B/token | "
            "batch-1 tok/s | offline tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    skipped = []
    for r in arms:
        if r.status != "done":
            skipped.append(f"- **{r.label}**: {r.status} — {r.reason}")
            continue
        n = r.numbers
        llama = r.engine == "llama.cpp"
        rows.append(" | ".join([f"| {r.label}", _engine(r),
                                _num(n.get("ppl"), ".3f") + (" (its windows)" if llama else ""),
                                _delta(r, base, f32_peer), _num(_mb(n.get("weight_bytes")), ".1f"),
                                _num(_mb(n.get("linear_bytes")), ".1f"),
                                _num(n.get("kv_bytes_per_token"), ","),
                                _num(n.get("decode_tokens_per_s"), ".1f")
                                + _rel(n.get("decode_tokens_per_s"),
                                       base.get("decode_tokens_per_s")),
                                _num(n.get("throughput_tokens_per_s"), ".1f")
                                + _rel(n.get("throughput_tokens_per_s"),
                                       base.get("throughput_tokens_per_s"))]) + " |")
    return (f"## {model}\n\nSpeed ratios in brackets are against kvslim float32 on this model.\n\n"
            + "\n".join(rows) + "\n\n" + _peer_notes(arms, exp.cfg)
            + ("**Not measured**:\n" + "\n".join(skipped) + "\n\n" if skipped else ""))


def _engine(r) -> str:
    n = r.numbers
    if r.engine == "llama.cpp":
        return f"llama.cpp, `{n.get('file')}`, -npl {n.get('throughput_parallel')}"
    if r.engine == "hf":
        return f"HF transformers, batch {n.get('throughput_batch')}"
    return "kvslim"


def _delta(r, base: dict, f32_peer: float | None) -> str:
    n = r.numbers
    if r.arm == "kv-int8" and n.get("ppl_float_kv"):
        return f"{(n['ppl'] - n['ppl_float_kv']) / n['ppl_float_kv']:+.2%} (vs float KV)"
    if r.engine == "llama.cpp":
        return f"{(n['ppl'] - f32_peer) / f32_peer:+.2%} (vs its f32)" if f32_peer else "—"
    if n.get("ppl") is None or not base.get("ppl"):
        return "—"
    return f"{(n['ppl'] - base['ppl']) / base['ppl']:+.2%}"


def _mb(v):
    return None if v is None else v / MB


def _peer_notes(arms: list, cfg) -> str:
    """llama.cpp's perplexity, on the windows it can run, against its own f32 and kvslim's."""
    peers = [r for r in arms if r.engine == "llama.cpp" and r.status == "done"]
    lines = []
    if peers:
        n0 = peers[0].numbers
        lines.append(
            f"llama.cpp's perplexity (`llama-perplexity --ppl-stride`) is on {n0['ppl_windows']} "
            f"({n0['ppl_tokens']:,} tokens scored): its strided mode cannot step a whole window, "
            f"so the kvslim rows' windows cannot be reproduced, and its deltas are against its "
            f"own f32 file. kvslim float32 on exactly these windows scores "
            f"{n0['kvslim_float_ppl_same_windows']:.3f}. The test file is "
            f"{n0['file_tokens_llamacpp']:,} tokens to llama.cpp and "
            f"{n0['file_tokens_kvslim']:,} to kvslim.")
        for r in peers:
            n = r.numbers
            sweep = ", ".join(f"{k}: {v:,.1f}" for k, v in n["throughput_sweep"].items())
            lines.append(f"- {r.label}: parallel decoding output tok/s by -npl: {sweep}")
    hf = next((r for r in arms if r.engine == "hf" and r.status == "done"), None)
    if hf:
        sweep = ", ".join(f"{k}: {v:,.1f}" for k, v in hf.numbers["throughput_sweep"].items())
        lines.append(f"- HF transformers output tok/s by batch size: {sweep}")
    kv = next((r for r in arms if r.arm == "kv-int8" and r.status == "done"), None)
    if kv:
        n = kv.numbers
        lines.append(f"- Capacity, KV budget {cfg.capacity_kv_memory}, sequences of "
                     f"{cfg.capacity_context} tokens: {n['capacity_peak']} sequences ran at once "
                     f"with the int8 KV cache, {n['capacity_peak_float_kv']} with the float cache "
                     f"({n['capacity_ratio']:.2f}x; {n['capacity_fit']} vs "
                     f"{n['capacity_fit_float_kv']} fit in the blocks).")
    return "\n".join(lines) + ("\n\n" if lines else "")


def _goals_section(exp: QuantExperiment) -> str:
    return ("## The goals, checked against the numbers above\n\n"
            + "\n".join(g.line() for g in goals(exp)) + "\n\n")


def _notes(exp: QuantExperiment) -> str:
    return """## Reading the numbers
- kvslim's quantized layers run their own kernels (int8 and int4 weight-only with bfloat16
  activations, `quantization/kernels.py`); `kvslim ppl` scores the dequantized weights, so the
  perplexity column measures the weights, not the kernels' activation rounding.
- The embedding and the (tied) LM head stay float32 in kvslim's checkpoints, which bounds how
  much smaller a quantized checkpoint gets; a GGUF file quantizes them too.
"""


def plot(exp: QuantExperiment, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = exp.model_keys()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        arms = [r for r in _arms(exp, model) if r.status == "done"
                and r.numbers.get("ppl") and r.numbers.get("weight_bytes")]
        for r in arms:
            peer = r.engine == "llama.cpp"
            ax.scatter(r.numbers["weight_bytes"] / MB, r.numbers["ppl"],
                       marker="s" if peer else "o", color="tab:orange" if peer else "tab:blue")
            ax.annotate(r.arm, (r.numbers["weight_bytes"] / MB, r.numbers["ppl"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("weight bytes (MB, log scale)")
        ax.set_ylabel("test perplexity")
        ax.set_title(f"{model} (squares: llama.cpp, its own windows)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
