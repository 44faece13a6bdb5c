"""The attention-backend section of docs/benchmarks.md, and the tables the two backend scripts
print: the CPU measurement behind the CPU default (`benchmarks/paged_attention_choice.py --out
docs/paged_attention_choice.json`) and the GPU check (`benchmarks/cuda_decode_check.py --out
docs/cuda_decode_check.json`), each rendered from the JSON its script wrote beside the page,
or shown as pending until it has run."""
from __future__ import annotations

import json
from pathlib import Path

CPU_FILE, GPU_FILE = "paged_attention_choice.json", "cuda_decode_check.json"


def attention_section(root: Path) -> str:
    cpu, gpu = (_read(root / name) for name in (CPU_FILE, GPU_FILE))
    return f"""
## Attention backends — gather vs FlexAttention

`--attention-backend` (`EngineConfig.attention_backend`) picks how paged attention reads the
KV cache:
- **gather** (`attention/paged.py`, the reference): every layer and step copies each sequence's
  context out of its blocks into a padded dense tensor, then runs SDPA (the decodes in one
  batched call, each prefill chunk in its own).
- **flex** (`attention/flex.py`): one FlexAttention call per layer for the whole step, decodes
  and chunks together, the layer's pool read in place as one key sequence. A mask_mod maps each
  pool slot back through its sequence's block table, and a block mask lists the blocks each
  tile of 16 queries may read (both built once per step and window,
  `attention/flex_metadata.py`). Compiled to Triton kernels on CUDA; eager on the CPU, where it
  scores every slot of the pool.
- **auto** (the default): what measured faster below: gather on CUDA (flex lost at these
  contexts on the H200), on the CPU the kernel where it runs, else gather. A quantized
  (int8/fp8) KV cache never takes flex: FlexAttention would read the raw elements.

### CPU: what set the default

{_cpu_part(cpu)}

### GPU: the prepared check

{_gpu_part(gpu)}
"""


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _cpu_part(cpu: dict | None) -> str:
    if cpu is None:
        return (f"Not measured yet: `python benchmarks/paged_attention_choice.py --out "
                f"docs/{CPU_FILE}`.")
    s, m = cpu["shape"], cpu["machine"]
    return (f"`{cpu['command']}` on {m['cpu']}, {m['torch_threads']} threads, torch "
            f"{m['torch']}: one layer's attention ({s['heads']} query heads over "
            f"{s['kv_heads']} KV heads, head_dim {s['head_dim']}, {s['dtype']}, blocks of "
            f"{s['block_size']}), the step's metadata built once and amortised over "
            f"{s['layers']} layers, median of {s['repeats']} steps; the pool holds exactly the "
            f"step's blocks, shuffled (a real, larger pool only slows the eager FlexAttention "
            f"further).\n\n{cpu_table(cpu)}")


def _gpu_part(gpu: dict | None) -> str:
    if gpu is None or gpu.get("smoke"):
        return ("Pending: not run on a GPU yet. On a CUDA machine (an H200: peak 4800 GB/s), "
                f"`python benchmarks/cuda_decode_check.py --out docs/{GPU_FILE}` checks greedy "
                "tokens of gather and flex, eager and with CUDA graphs, against the eager gather "
                "engine, and measures batch-1 decode (with its fraction of HBM bandwidth), "
                "offline throughput at batch 64 and HF transformers on SmolLM2-135M (float32) "
                "and a random-weight 1B Llama (bfloat16); `kvslim bench report --from-json "
                "docs/benchmarks.json` then puts its table here.")
    return f"`{gpu['command']}`:\n\n{gpu_table(gpu)}\n\n{gpu_goals(gpu)}"


# The model the bandwidth goal is set on (benchmarks/cuda_decode_check.py's random 1B Llama):
# a small model's step is launch-bound, not bandwidth-bound.
HBM_GOAL_MODEL = "llama-1B-random"


def gpu_goals(report: dict) -> str:
    """The GPU goals (parity on every engine; the fastest engine's batch-1 decode >= 70% of
    HBM bandwidth on the 1B shape, >= 3x HF's batch-1 rate and >= 5x its offline throughput),
    each PASS or FAIL from the report's numbers."""
    lines = ["Goals, from these numbers:", ""]
    for m in report["models"]:
        runs = [e for e in m["engines"] if "error" not in e]
        same = all(e["tokens_identical"] for e in runs) and len(runs) == len(m["engines"])
        lines.append(f"- {m['model']} ({m['dtype']}): greedy parity on every engine "
                     f"{'PASS' if same else 'FAIL'}")
        alone = [e["batched_equals_alone"] for e in runs if "batched_equals_alone" in e]
        if alone:
            prompts = report["plan"]["check_prompts"]
            lines.append(f"- {m['model']} ({m['dtype']}): batched = alone on every engine, "
                         f"{min(alone)} of {prompts} prompts at worst "
                         f"{'PASS' if min(alone) == prompts else 'FAIL'}")
        rated = [e for e in runs if e.get("decode_tok_s", 0) > 0]
        hf = m["hf"]
        if not rated or "decode_tok_s" not in hf:
            continue
        best = max(rated, key=lambda e: e["decode_tok_s"])
        top = max(e["throughput_tok_s"] for e in runs)
        b1, off = best["decode_tok_s"] / hf["decode_tok_s"], top / hf["throughput_tok_s"]
        lines.append(f"- {m['model']}: batch-1 {b1:.1f}x HF transformers (>= 3x: "
                     f"{'PASS' if b1 >= 3 else 'FAIL'}), offline {off:.1f}x (>= 5x: "
                     f"{'PASS' if off >= 5 else 'FAIL'})")
        if m["model"] == HBM_GOAL_MODEL and best.get("hbm_fraction") is not None:
            frac = best["hbm_fraction"]
            lines.append(f"- {m['model']}: batch-1 decode at {frac:.0%} of HBM bandwidth "
                         f"(>= 70%: {'PASS' if frac >= 0.7 else 'FAIL'})")
    return "\n".join(lines)


def cpu_table(result: dict) -> str:
    """benchmarks/paged_attention_choice.py's result: ms per layer of each backend, and each
    against gather (the reference)."""
    backends = result.get("backends", ["gather", "flex"])
    others = [b for b in backends if b != "gather"]
    lines = ["| step | pool blocks | " + " | ".join(f"{b} ms/layer" for b in backends)
             + "".join(f" | {b} / gather" for b in others) + " |",
             "|---|---|" + "---|" * (len(backends) + len(others))]
    for r in result["results"]:
        what = (f"decode, batch {r['sequences']}, context {r['context']}" if r["kind"] == "decode"
                else f"prefill chunk of {r['new_tokens']} after "
                     f"{r['context'] - r['new_tokens']} cached")
        cells = [f"{r[f'{b}_ms']:.2f}" for b in backends]
        cells += [f"{r[f'{b}_ms'] / r['gather_ms']:.2f}x" for b in others]
        lines.append(f"| {what} | {r['pool_blocks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nFaster on the CPU: **{result['choice']}**."


def gpu_table(report: dict) -> str:
    plan = report["plan"]
    graphs = "CUDA graphs" if report["device"] == "cuda" else "graphs' padded path, eager"
    lines = ["| model | engine | tokens = eager gather | batched = alone "
             "| batch-1 decode tok/s | GB/s | of HBM "
             f"| offline tok/s ({plan['batch']} x {plan['new_tokens']}) | start-up s |",
             "|" + "---|" * 9]
    for m in report["models"]:
        model = f"{m['model']} ({m['dtype']})"
        lines += [_engine_row(model, e, graphs, plan.get("check_prompts")) for e in m["engines"]]
        lines.append(_hf_row(model, m["hf"]))
    return "\n".join(lines + [""] + [f"- {note}" for note in report["notes"]]
                     + _weights_tables(report) + _profile_tables(report))


def _profile_tables(report: dict) -> list[str]:
    """Where a batch-1 decode step of each profiled engine goes (cuda_step_profile.py)."""
    rows = [(m["model"], e) for m in report["models"] for e in m["engines"] if "profile" in e]
    if not rows:
        return []
    out = ["", "Where a batch-1 decode step goes (ms per step; host phases from the profiler, "
           "device-busy: the kernels' own time):", "",
           "| model | engine | step | device busy | device idle | launches | graph launches | "
           + " | ".join(PROFILE_PHASES) + " | rest of step |",
           "|" + "---|" * (8 + len(PROFILE_PHASES))]
    for model, e in rows:
        p = e["profile"]
        host = p["host_ms_per_step"]
        out.append(f"| {model} | {e['backend']}, {_mode(e, 'graphs')} | "
                   f"{p['wall_ms_per_step']:.2f} | {_ms(p.get('device_busy_ms_per_step'))} | "
                   f"{_pct(p.get('device_idle_fraction'))} | "
                   f"{p.get('kernel_launches_per_step', '—')} | "
                   f"{p.get('graph_launches_per_step', '—')} | "
                   + " | ".join(f"{host[k]:.2f}" for k in PROFILE_PHASES)
                   + f" | {p['host_ms_outside_phases']:.2f} |")
    top = [(model, e, k) for model, e in rows for k in e["profile"].get("top_kernels", [])[:5]]
    if top:
        out += ["", "| model | engine | kernel | ms per step | calls per step |",
                "|---|---|---|---|---|"]
        out += [f"| {model} | {e['backend']}, {_mode(e, 'graphs')} | "
                f"`{k['name'][:70]}` | {k['ms_per_step']:.3f} | {k['calls_per_step']} |"
                for model, e, k in top]
    return out


PROFILE_PHASES = ("schedule", "prepare", "graph", "logits", "sample", "postprocess")


def _ms(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def _weights_tables(report: dict) -> list[str]:
    """The optional checks' engines (--quantized, --sparse24): one table each, when run."""
    out = []
    for key, what in (("quantized", "weights"), ("sparse24", "cuda_sparse_24")):
        part = report.get(key) or {}
        if "engines" not in part:
            if part:
                out += ["", f"`--{key}`: {part.get('skipped') or part.get('error')}"]
            continue
        out += _kernel_rows(part.get("kernels"))
        out += ["", f"`--{key}` on {part['model']}:", "",
                "| engine | batch-1 decode tok/s | offline tok/s | prompts with the reference's "
                "greedy tokens | batched = alone | start-up s |", "|---|---|---|---|---|---|"]
        for e in part["engines"]:
            same = e.get("prompts_equal_bf16", e.get("tokens_equal_dense"))
            same = "—" if same is None else f"{same} of {e['prompts']}"
            start = e.get("startup_s")
            alone = e.get("batched_equals_alone")
            alone = "—" if alone is None else f"{alone} of {e['prompts']}"
            out.append(f"| {what} = {e[what]} | {_rate(e.get('decode_tok_s'))} | "
                       f"{e.get('throughput_tok_s', e.get('error', '—')[:120])} | {same} | "
                       f"{alone} | "
                       f"{'—' if start is None else f'{start:.1f}'} |")
    return out


def _kernel_rows(kernels: list[dict] | None) -> list[str]:
    """cuda_quantized_check.py's kernel check: each kernel against the dequantized weight."""
    if not kernels:
        return []
    out = ["", "Quantized kernels on a 2048 x 2048 layer, against float32 arithmetic on the "
           "dequantized weight:", "",
           "| kernel | ran | largest error / largest output | rows batch-invariant (1, 8, 64) |",
           "|---|---|---|---|"]
    for k in kernels:
        if "error" in k:
            out.append(f"| — | {k['error'][:120]} | — | — |")
            continue
        out.append(f"| {k['kernel']} | {k['path']} | {k['max_rel_error']:.2e} | "
                   f"{'yes' if k['rows_batch_invariant'] else 'no'} |")
    return out


def _rate(x) -> str:
    """A tokens/s figure; a negative one timed a compilation into its first token (the first
    GPU run's warm-up missed that shape), so it measured nothing."""
    if x is None:
        return "—"
    return str(x) if x > 0 else "not measured (a compilation fell inside the timing)"


def _engine_row(model: str, e: dict, graphs: str, prompts: int) -> str:
    name = f"kvslim {e['backend']}, {_mode(e, graphs)}"
    if "error" in e:
        same = f"error: {e['error'][:80]}"
    else:
        same = "yes" if e["tokens_identical"] else f"no (prompt, token) {e['first_difference']}"
    rate = e.get("decode_tok_s")
    valid = rate is not None and rate > 0
    alone = e.get("batched_equals_alone")
    alone = "—" if alone is None else f"{alone} of {prompts}"
    return (f"| {model} | {name} | {same} | {alone} | {_rate(rate)} | "
            f"{e.get('gb_s', '—') if valid else '—'} | "
            f"{_pct(e.get('hbm_fraction')) if valid else '—'} | "
            f"{e.get('throughput_tok_s', '—')} | {e.get('startup_s', 0):.1f} |")


def _mode(e: dict, graphs: str) -> str:
    """How an engine runs its decode steps: eager, graphs, or a compiled step in the graphs."""
    if not e["graphs"]:
        return "eager"
    if not e.get("compiled"):
        return graphs
    return "graphs' padded path, compiled" if "eager" in graphs else f"{graphs}, compiled step"


def _hf_row(model: str, hf: dict) -> str:
    other = hf.get("skipped") or hf.get("error")
    if other:
        return f"| {model} | HF transformers | {other} | | | | | | |"
    return (f"| {model} | {hf['label']}, best batch {hf['best_batch']} | — | — | "
            f"{hf['decode_tok_s']} | {hf.get('gb_s', '—')} | {_pct(hf.get('hbm_fraction'))} | "
            f"{hf['throughput_tok_s']} | — |")


def _pct(x) -> str:
    return "—" if x is None else f"{x:.0%}"
