"""The report of `kvslim experiment prune`: docs/pruning.md, its JSON (every number, the settings
and the machine) and a plot of perplexity against sparsity, written only from the recorded
results (and, when present, the sparse-kernel probe's JSON beside the report)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from kvslim_lab.experiments.prune.arms import DENSE, DENSE_4BIT, arm_name, target_label
from kvslim_lab.experiments.prune.goals import goals, numbers, ppl
from kvslim_lab.experiments.prune.study import PruneExperiment

MB = 1e6
KERNEL_JSON = "pruning_kernel.json"
KERNEL_COMMAND = ("python benchmarks/sparse_kernel.py --threads 1 --rounds 11 "
                  "--json docs/pruning_kernel.json")


def report_data(exp: PruneExperiment, command: str, machine: dict) -> dict:
    return {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine, "settings": asdict(exp.cfg),
            "arms": {k: asdict(v) for k, v in exp.results.items()
                     if v.model in exp.model_keys()},
            "goals": [asdict(g) for g in goals(exp)]}


def write_report(exp: PruneExperiment, command: str, machine: dict) -> Path:
    report = Path(exp.cfg.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    data = report_data(exp, command, machine)
    image = plot(exp, report.parent / "img" / f"{report.stem}.png")
    text = (_header(exp, data)
            + "## Goals\n\n" + "".join(g.line() + "\n" for g in goals(exp)) + "\n"
            + f"![perplexity against sparsity](img/{image.name})\n\n"
            + "".join(_model_section(exp, m) for m in exp.model_keys())
            + _kernel_section(report.parent / KERNEL_JSON) + _failures(exp))
    report.write_text(text)
    report.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    return report


def _header(exp: PruneExperiment, data: dict) -> str:
    cfg, m = exp.cfg, data["machine"]
    return f"""# Pruning: measured

Written by one command (it resumes: finished arms are recorded in `{cfg.work_dir}/results.json`;
every number is in [{Path(cfg.report).with_suffix('.json').name}]({Path(cfg.report).with_suffix('.json').name})):

```bash
{data["command"]}
```

Machine: {m.get("cpu")}, {m.get("cores")} cores, torch {m.get("torch")}. Date: {data["date"]}.

- **Pruning** (`kvslim prune`, `src/kvslim/surgery/prune/`): every decoder linear, layer by
  layer on the inputs of the layers pruned before it; a fraction of each output row, or N of
  every M consecutive inputs. Calibration (Wanda, SparseGPT, GPTQ): {cfg.calib_samples} windows
  of {cfg.calib_seq_len} tokens of `{cfg.calib}`.
- **Perplexity** (`kvslim ppl`): `{cfg.test}`, windows of {cfg.ppl_context} tokens, stride
  {cfg.ppl_stride}, first {cfg.ppl_max_tokens or 'all'} tokens. Deterministic.
- **4-bit**: kept weights on a symmetric grid with one scale per {cfg.group_size} inputs (SparseGPT
  jointly, the others round to nearest after pruning), stored in the GPTQ layout; the dense
  reference is GPTQ at the same grid.
- **Recovery**: `kvslim uptrain`'s loop for {cfg.recovery_tokens:,} tokens of `{cfg.calib}`
  (batch {cfg.recovery_batch_size} x {cfg.recovery_seq_len}, peak lr {cfg.recovery_lr}),
  distilled from the dense model (T = 2, weight 0.5); the pruned weights stay zero
  (`train/pruned_masks.py`).
- **Batch-1 decode** ({cfg.decode_input_len} prompt tokens, {cfg.decode_output_len} generated,
  `kvslim bench latency`'s measure): a model's decode arms loaded together and timed in turn,
  {cfg.decode_repeats} rounds, the median time per token; a model pruned 2:4 in float32 runs
  kvslim's 2:4 kernel (below); any other pruned model runs the dense kernels of its precision,
  so dense against SparseGPT 50% shows what is left of this shared CPU's noise. Deleting one
  arm's `decode_tokens_per_s` from the records re-measures them all on the next run.

"""


def _pct(value: float | None, base: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" + ("" if not base else f" ({value / base - 1:+.1%})")


def _model_section(exp: PruneExperiment, model: str) -> str:
    cfg, dense = exp.cfg, ppl(exp, model, DENSE)
    rows = [f"| dense | {_pct(dense, None)} | | | |"]
    for t in cfg.targets:
        cells = [_pct(ppl(exp, model, arm_name(m, t, None)), dense) for m in cfg.methods]
        n = numbers(exp, model, arm_name(cfg.methods[-1], t, None)) or {}
        zeros = f"{n['linear_zeros']:.1%}" if "linear_zeros" in n else "—"
        rows.append(f"| {target_label(t)} | " + " | ".join(cells) + f" | {zeros} |")
    head = "| sparsity | " + " | ".join(cfg.methods) + " | zeros stored |\n"
    return (f"## {model}\n\nTest perplexity (change against dense):\n\n" + head
            + "|---" * (len(cfg.methods) + 2) + "|\n" + "\n".join(rows) + "\n\n"
            + _bytes_table(exp, model) + _quantized_table(exp, model)
            + _recovery_table(exp, model)
            + _decode_table(exp, model))


def _bytes_table(exp: PruneExperiment, model: str) -> str:
    """The float pruned arms' linears as compressed-tensors sparse checkpoints (`kvslim prune
    --format compressed-tensors`) against the dense-written ones."""
    dense = numbers(exp, model, DENSE) or {}
    rows = []
    for t in exp.cfg.targets:
        n = numbers(exp, model, arm_name(exp.cfg.methods[-1], t, None)) or {}
        if "sparse_linear_bytes" in n:
            fmt = "sparse-24-bitmask" if t == "2:4" else "sparse-bitmask"
            rows.append(f"| {target_label(t)} | {fmt} | {n['linear_bytes'] / MB:.2f} | "
                        f"{n['sparse_linear_bytes'] / MB:.2f} | "
                        f"{n['sparse_linear_bytes'] / n['linear_bytes']:.2f} |")
    if not rows:
        return ""
    bf16 = dense.get("linear_bf16_bytes", 0) / MB
    return (f"Linears on disk, {exp.cfg.methods[-1]} arms (values in the checkpoint's dtype; "
            f"bf16 dense: {bf16:.2f} MB):\n\n| sparsity | compressed-tensors format | dense MB | "
            "sparse MB | ratio |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n")


def _quantized_table(exp: PruneExperiment, model: str) -> str:
    cfg, dense = exp.cfg, numbers(exp, model, DENSE) or {}
    bf16 = dense.get("linear_bf16_bytes")
    names = [DENSE_4BIT] + [arm_name(m, t, cfg.bits) for t in cfg.quantized_targets
                            for m in cfg.methods]
    rows = []
    for name in names:
        n = numbers(exp, model, name)
        if n is None:
            continue
        share = f"1/{bf16 / n['linear_bytes']:.2f}" if bf16 else "—"
        rows.append(f"| {name} | {_pct(n['ppl'], dense.get('ppl'))} | "
                    f"{n['linear_bytes'] / MB:.2f} | {share} | {n['weight_bytes'] / MB:.2f} |")
    if not rows:
        return ""
    return (f"With {cfg.bits}-bit kept weights (linears' bytes against their bf16 bytes, "
            f"{(bf16 or 0) / MB:.2f} MB):\n\n| arm | perplexity | linears MB | of bf16 | all "
            "weights MB |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n")


def _recovery_table(exp: PruneExperiment, model: str) -> str:
    dense = ppl(exp, model, DENSE)
    rows = []
    for r in exp.results.values():
        if r.model != model or not r.arm.endswith("+rec") or r.status != "done":
            continue
        before = ppl(exp, model, r.arm.removesuffix("+rec"))
        rows.append(f"| {r.arm.removesuffix('+rec')} | {_pct(before, dense)} | "
                    f"{_pct(r.numbers['ppl'], dense)} | {exp.cfg.recovery_tokens:,} | "
                    f"{r.numbers['build_seconds'] / 60:.1f} | "
                    f"{r.numbers.get('linear_zeros', 0):.1%} |")
    if not rows:
        return ""
    return ("Recovery uptraining (distilled from the dense model, zeros kept):\n\n| arm | before |"
            " after | tokens | minutes | zeros stored after |\n|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n\n")


def _decode_table(exp: PruneExperiment, model: str) -> str:
    rows = []
    for name in exp.cfg.decode_arms():
        n = numbers(exp, model, name)
        if n and "decode_tokens_per_s" in n:
            rows.append(f"| {name} | {n['decode_tokens_per_s']:.1f} | "
                        f"{n['weight_bytes'] / MB:.2f} |")
    if not rows:
        return ""
    return ("Batch-1 decode:\n\n| arm | tokens/s | weight MB |\n|---|---|---|\n"
            + "\n".join(rows) + "\n\n")


def _kernel_section(path: Path) -> str:
    """The 2:4 kernel probe's batch-1 rows (weights streamed from memory) and its whole-step
    totals, from its JSON."""
    if not path.is_file():
        return ""
    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if r["m"] == 1 and r["where"] == "memory"]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    us = {(r["shape"], r["kernel"]): r["us"] for r in rows}
    lines = [f"| {shape} | " + " | ".join(f"{us[(shape, k)]:.0f}" if (shape, k) in us else "—"
                                          for k in kernels) + " |" for shape in shapes]
    steps = {(t["m"], t["kernel"]): t["step_us"] for t in data["step_totals"]
             if t["where"] == "memory"}
    lines += [f"| SmolLM2 step, {m} row{'s' * (m > 1)} | " + " | ".join(
        f"{steps[(m, k)] / 1e3:.1f} ms" if (m, k) in steps else "—" for k in kernels) + " |"
        for m in data["batches"]]
    m = data["machine"]
    return (f"## The 2:4 kernel on this CPU\n\n`{KERNEL_COMMAND}` ({m['cpu']}, "
            f"{', '.join(map(str, data['threads']))} thread(s), weights streamed from {data['stream_mb']} MB of "
            f"copies; memory read {data['read_gb_s']} GB/s in that run). Median µs per call at "
            "one row; the last rows: every linear of a SmolLM2-135M decode step:\n\n"
            "| shape | " + " | ".join(kernels) + " |\n" + "|---" * (len(kernels) + 1) + "|\n"
            + "\n".join(lines) + "\n\n"
            "A model pruned 2:4 in float32 runs this kernel in every decoder linear "
            "(`layers/cpu_linear.py`), at every row count: its arithmetic does not change with "
            "the batch.\n\n"
            "On CUDA, `--cuda-sparse-24` (`layers/cuda_sparse24.py`) runs a 2:4 float16/bfloat16 "
            "model's linears as PyTorch's semi-structured sparse tensors; opt-in until "
            "`python benchmarks/cuda_sparse24_check.py` measures it against the dense kernels on "
            "a GPU (not run yet: no GPU was available).\n\n")


def _failures(exp: PruneExperiment) -> str:
    bad = [r for r in exp.results.values()
           if r.model in exp.model_keys() and r.status != "done"]
    if not bad:
        return ""
    return "## Arms that failed\n\n" + "".join(f"- {r.model}/{r.arm}: {r.reason}\n"
                                               for r in bad) + "\n"


def plot(exp: PruneExperiment, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = exp.model_keys()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method, color in zip(exp.cfg.methods, ("tab:gray", "tab:blue", "tab:red")):
            points = [(float(t), ppl(exp, model, arm_name(method, t, None)))
                      for t in exp.cfg.targets if ":" not in t]
            points = [(x, y) for x, y in [(0.0, ppl(exp, model, DENSE))] + points
                      if y is not None]
            if points:
                ax.plot(*zip(*points), "o-", color=color, label=method)
            for t in (t for t in exp.cfg.targets if ":" in t):
                y = ppl(exp, model, arm_name(method, t, None))
                if y is not None:
                    n, m = (int(v) for v in t.split(":"))
                    ax.scatter(1 - n / m, y, marker="s" if m == 4 else "^", color=color)
        ax.set_yscale("log")
        ax.set_xlabel("fraction of each row pruned (squares 2:4, triangles 4:8)")
        ax.set_ylabel("test perplexity (log)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
