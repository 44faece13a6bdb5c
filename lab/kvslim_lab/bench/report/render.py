"""docs/benchmarks.md from one report's JSON alone (`--from-json` re-renders it without
measuring): the run's command, machine and bandwidth, the goals, then a section per part."""
from __future__ import annotations

import json
from pathlib import Path

from kvslim_lab.bench.attention_report import attention_section
from kvslim_lab.bench.compiled_decode import decode_table
from kvslim_lab.bench.peers.render import markdown as peers_markdown
from kvslim_lab.bench.profile import CATEGORIES
from kvslim_lab.bench.report.goals import check_goals, op_name
from kvslim_lab.bench.report.plan import PARTS
from kvslim.errors import KvslimError

REQUIRED = ("command", "started", "minutes", "threads", "machine", "bandwidth", "peers")


def load(path: Path) -> dict:
    """A report's JSON, or a one-line KvslimError saying why it is not one."""
    from kvslim_lab.bench.report.measure import FORMAT
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise KvslimError(f"--from-json {path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise KvslimError(f"--from-json {path}: not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("report") != FORMAT:
        raise KvslimError(f"--from-json {path}: not the JSON of `kvslim bench report` "
                          f"(format {FORMAT}; an older report's cannot be re-rendered)")
    missing = [k for k in REQUIRED if d.get(k) is None]
    if missing:
        raise KvslimError(f"--from-json {path}: no {', '.join(missing)} in it")
    return d


def write_page(d: dict, out: Path) -> Path:
    """OUT (markdown), OUT.json and the PNGs under OUT's folder/img, from `d`."""
    from kvslim_lab.bench.report.plots import plot_all
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        images = plot_all(d, out.parent / "img")
        text = render(d, {k: p.relative_to(out.parent) for k, p in images.items()}, out.parent)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise KvslimError(f"a report JSON without a field the page needs "
                          f"({type(e).__name__}: {e})") from None
    out.with_suffix(".json").write_text(json.dumps(d, indent=2) + "\n")
    out.write_text(text)
    return out


def render(d: dict, images: dict[str, Path], root: Path) -> str:
    sections = [intro(d), peers_section(d, images.get("peers")), ref_section(d),
                compiled_section(d, images.get("compiled")), startup_section(d),
                profile_section(d), capacity_section(d, images.get("capacity")),
                skipped_section(d), attention_section(root)]
    return "\n".join(s for s in sections if s)


def _rounds(n: int) -> str:
    return f"{n} round{'s' if n != 1 else ''}"


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def intro(d: dict) -> str:
    m, bw = d["machine"], d["bandwidth"]
    goals = "\n".join(g.line() for g in check_goals(d))
    return f"""# Benchmarks

Every number on this page, but the attention backends' (measured by the scripts named there),
was measured by one command, in one run of {d['minutes']:.0f} minutes started {d['started']}:

```bash
{d['command']}
```

Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, torch {m['torch']}, Python
{m['python']}; every engine ran with {d['threads']} threads. Memory bandwidth measured in the same
run: {bw['read_gb_s']} GB/s read, {bw['copy_gb_s']} GB/s copy (read + write). Raw results:
`benchmarks.json`; `kvslim bench report --from-json docs/benchmarks.json` re-renders this page
from it.

## Goals (issue 31), checked against the numbers below

{goals}
"""


def peers_section(d: dict, image: Path | None) -> str:
    return (f"## kvslim and its peers at their best — SmolLM2-135M-Instruct\n\n"
            f"The engines of `kvslim bench peers` (benchmarks/README.md says what each runs), "
            f"taking turns round by round on the same token ids.\n\n{peers_markdown(d['peers'])}"
            + (f"\n![peers]({image})\n" if image else ""))


def ref_section(d: dict) -> str:
    ref = d.get("ref")
    if not ref:
        return ""
    p = ref["peers"]
    dec = p["plan"]["decode"]
    rows = [[e["label"], "skipped: " + e["reason"], "", ""] if e["status"] == "skipped" else
            [e["label"], f"{e['decode']['tokens_per_s']:.1f}", f"{e['decode']['tpot_ms']:.2f}",
             e["reason"] or ""] for e in p["engines"]]
    return f"""## The reference model ({ref['model']}) at batch 1

The project's own 6-layer MHA Llama (`models/{ref['model']}`), {dec['input_len']}-token prompt,
{dec['output_len']} new tokens, the engines taking turns ({_rounds(p['plan']['rounds'])}); llama.cpp runs its
Q4_0 and Q4_1 files (`llama-quantize` of its F32 export), kvslim the Q4_1 file's blocks (the same
file, imported) and the float32 model as trained. Medians over the rounds.

{_table(["engine", "batch-1 tok/s", "TPOT ms", "note"], rows)}
"""


def compiled_section(d: dict, image: Path | None) -> str:
    rows = d.get("compiled_decode")
    if not rows:
        return ""
    s = d["settings"]
    apart = [str(r["batch"]) for r in rows if not r["greedy_identical"]]
    return f"""## The compiled decode step against eager (`--compile`)

The peers run's two kvslim engines on the shipped Q4_1 blocks (`kvslim-q4_1`,
`kvslim-q4_1+compile`), before its rounds: at each batch, fresh random {s['input_len']}-token
prompts and {s['decode_len']} new tokens, the two engines taking turns
({_rounds(d['plan']['compiled_rounds'])}); a batch's rate is its size over its requests' mean time
per output token, the median over the rounds (`kvslim_lab.bench.compiled_decode`, which
`benchmarks/compiled_decode.py` runs too). Greedy tokens {'parted at batch ' + ', '.join(apart) if apart else 'were the same at every batch'}.

{decode_table(rows)}
""" + (f"\n![compiled vs eager]({image})\n" if image else "")


def startup_section(d: dict) -> str:
    rows = [[r["label"], "skipped: " + r["reason"], ""] if r["status"] != "ran" else
            [r["label"], f"{r['ready_s']:.1f}", f"{r['first_answer_s']:.1f}"]
            for r in d.get("startup") or []]
    if not rows:
        return ""
    return f"""## Start-up of `kvslim serve`

Seconds from launching `kvslim serve` (the default model, `--max-num-seqs` of the peers run's
engines, the other options their defaults) to its listening, and to its answer to one completion
sent as soon as it listens, after the peers run. The compiled server's is a second start: the
peers run's compiled engine built the same programs (the same model, batch and KV-cache sizes)
into the same compile cache before it.

{_table(["server", "listening after s", "first answer after s"], rows)}
"""


def profile_section(d: dict) -> str:
    found = [(f"SmolLM2 Q4_1, {mode}", p) for mode, p in (d.get("profile") or {}).items() if p]
    ref = d.get("ref") or {}
    if ref.get("profile"):
        found.append((f"{ref['model']}, {ref['profiled_engine']}", ref["profile"]))
    if not found:
        return ""
    rows, top = [], []
    for name, prof in found:
        p = prof["profiles"][0]
        ms, total = p["ms_per_step"], p["profiled_step_ms"]
        rows.append([name, f"{p['step_ms']:.1f}", f"{total:.1f}"]
                    + [f"{ms[c]:.1f} ({ms[c] / total:.0%})" for c in CATEGORIES]
                    + [f"{p.get('op_calls', 0):.0f}"])
        top.append(f"- {name}: " + ", ".join(f"{op_name(n)} {t} ms" for n, t in p["top_ops"]))
    steps = found[0][1]["profiles"][0]["steps"]
    return f"""## Where a batch-1 decode step's time goes

torch's profiler over {steps} pure decode steps (`kvslim bench profile`'s machinery): self time
of the matrix products, of attention (KV-cache writes and block gathers included), of every other
operation, and the rest of the step outside any operation (Python, dispatch, scheduling,
sampling bookkeeping). The profiler adds a little to every operation, so shares are of the
profiled step; the unprofiled step is beside it. A compiled program's fused loops count as
other ops (its own profiler event holds them).

{_table(["model, engine", "step ms", "profiled ms", "GEMM", "attention", "other ops",
         "outside ops", "op calls"], rows)}

The costliest operations, ms per step:
{chr(10).join(top)}
"""


def capacity_section(d: dict, image: Path | None) -> str:
    cap = d.get("capacity")
    if not cap:
        return ""
    base = cap["entries"][0]
    rows = [[e["model"], e["kv_heads"], f"{e['kv_bytes_per_token']:,}", e["num_blocks"],
             e["max_sequences"], f"{e['max_sequences'] / base['max_sequences']:.2f}x",
             e["peak_running"], f"{e['output_tokens_per_s']:.1f}", e["preemptions"]]
            for e in cap["entries"]]
    generated = max(4, cap["context"] // 16)
    return f"""## Capacity — one KV-cache budget ({cap['kv_cache_memory'] / 2**20:.0f} MiB), MHA vs its GQA/MQA conversions

The reference model and its mean-pooled conversions; sequences of {cap['context']} tokens
({cap['context'] - generated} prompt + {generated} generated), {cap['num_requests']} requests
submitted at once, so that the cache, not `max_num_seqs`, limits the batch. "fit" counts whole
sequences in the allocated blocks; "peak" is the most sequences the engine ran in one step.

{_table(["model", "KV heads", "KV bytes/token", "blocks", "fit", "vs MHA", "peak running",
         "output tokens/s", "preemptions"], rows)}
""" + (f"\n![capacity]({image})\n" if image else "")


def skipped_section(d: dict) -> str:
    skipped = d.get("skipped") or {}
    if not skipped:
        return ""
    return "## Not measured in this run\n\n" + "\n".join(
        f"- {PARTS.get(part, part)}: {why}" for part, why in skipped.items()) + "\n"
