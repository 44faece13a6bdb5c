"""The compiled CPU decode step (engine/cpu_compile.py) against the eager one, batch by batch:
two engines on the same model held in one process, taking turns in every round on the same
fresh prompts; a batch's decode rate is its size over its requests' mean time per output token
(medians over the rounds), and the greedy tokens of the two are compared. Prefix caching is off,
so that every round computes its prompts afresh in both. `kvslim bench report` runs it on the
peers run's own engines; `benchmarks/compiled_decode.py` adds the start-up timing."""
from __future__ import annotations

import statistics

import torch
from tqdm import tqdm

from kvslim.engine.sampling_params import SamplingParams

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def build_engines(model: str | None, max_num_seqs: int) -> dict:
    """{"eager": LLM, "compiled": LLM} on `model` (None: the default model, its shipped
    blocks)."""
    from kvslim.engine.llm import LLM
    options = dict(max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    return {"eager": LLM(model, **options), "compiled": LLM(model, compile_decode=True, **options)}


def decode_rate(llm, prompts, output_len: int) -> tuple[float, list[list[int]]]:
    """Output tokens per second of the batch's decode steps (the batch over its requests'
    mean time per output token after the first) and the greedy tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tpot = statistics.mean(o.metrics.time_per_output_token for o in outs)
    return len(prompts) / tpot, [o.outputs[0].token_ids for o in outs]


def compare(engines: dict, batches=BATCHES, input_len: int = 128, output_len: int = 64,
            rounds: int = 2, show_progress: bool = True) -> list[dict]:
    """One row per batch: eager_tok_s, compiled_tok_s, speedup, greedy_identical (in every
    round). `engines`: {"eager": LLM, "compiled": LLM}."""
    rates = {(e, b): [] for e in engines for b in batches}
    same = {}
    g = torch.Generator().manual_seed(0)
    steps = [(r, b) for r in range(rounds) for b in batches]
    for _, batch in tqdm(steps, desc="eager vs compiled", unit="batch",
                         disable=not show_progress):
        prompts = [torch.randint(100, 20000, (input_len,), generator=g).tolist()
                   for _ in range(batch)]
        tokens = {}
        for name, llm in engines.items():
            rate, tokens[name] = decode_rate(llm, prompts, output_len)
            rates[(name, batch)].append(rate)
        same[batch] = same.get(batch, True) and tokens["eager"] == tokens["compiled"]
    rows = []
    for batch in batches:
        tok_s = {e: statistics.median(rates[(e, batch)]) for e in engines}
        rows.append({"batch": batch, "eager_tok_s": round(tok_s["eager"], 2),
                     "compiled_tok_s": round(tok_s["compiled"], 2),
                     "speedup": round(tok_s["compiled"] / tok_s["eager"], 3),
                     "greedy_identical": same[batch]})
    return rows


def decode_table(rows: list[dict]) -> str:
    lines = ["| batch | eager tok/s | compiled tok/s | compiled is | greedy identical |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['eager_tok_s']:.1f} | {r['compiled_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {'yes' if r['greedy_identical'] else 'NO'} |"
              for r in rows]
    return "\n".join(lines)
