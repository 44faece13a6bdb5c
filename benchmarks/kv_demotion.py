"""Demotion against preemption under overload (`--kv-pressure demote|preempt`): N requests of
held-out text whose prompts and greedy continuations need `--overload` times the blocks the
pool holds, run to the end through `LLM.generate` in each mode with the same KV bytes, beside
an unpressured run (a pool that holds them all). Per run: wall time, output tokens/s,
preemptions, blocks demoted, and the perplexity of its continuations scored by the unpressured
engine (each prompt + continuation's prompt logprobs, full precision), plus how many
continuations equal the unpressured run's. Runs go unpressured, then preempt and demote
alternately (A B A B), each mode's rate the mean of its runs.

    python benchmarks/kv_demotion.py [--model NAME] [--requests 16] [--prompt 256]
        [--max-tokens 256] [--overload 2] [--repeats 2] [--threads 2] [--json]
        [--out docs/kv_budget/demotion.json]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvslim import LLM, SamplingParams


def prompts_of(llm: LLM, text: str, n: int, tokens: int) -> list[list[int]]:
    """n prompts of `tokens` tokens from consecutive stretches of the text."""
    ids = llm.tokenizer.encode(text)
    if len(ids) < n * tokens:
        raise SystemExit(f"the text holds {len(ids)} tokens, {n * tokens} needed")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(n)]


def generate(llm: LLM, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def perplexity(scorer: LLM, prompts, continuations) -> float:
    """exp of the mean negative log-likelihood of the continuations' tokens after their
    prompts, read by the unpressured engine (prompt logprobs)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = scorer.generate([p + c for p, c in zip(prompts, continuations)], params,
                           use_tqdm=False)
    nll = [-lp.logprob for o, p in zip(outs, prompts) for lp in o.prompt_logprobs[len(p):]]
    return math.exp(sum(nll) / len(nll))


def run_mode(llm: LLM, prompts, max_tokens: int, reference, scorer: LLM) -> dict:
    before = llm.engine.kv_cache_stats()
    seconds, conts = generate(llm, prompts, max_tokens)
    after = llm.engine.kv_cache_stats()
    return {"seconds": round(seconds, 2),
            "tok_s": round(sum(map(len, conts)) / seconds, 2),
            "preemptions": after.num_preemptions - before.num_preemptions,
            "demoted_blocks": after.num_demoted_blocks - before.num_demoted_blocks,
            "ppl": round(perplexity(scorer, prompts, conts), 4),
            "same_as_unpressured": sum(c == r for c, r in zip(conts, reference))}


def measure(args) -> dict:
    text = Path(args.data).read_text(encoding="utf-8", errors="replace")
    length = args.prompt + args.max_tokens
    common = dict(max_num_seqs=args.requests, max_model_len=length + 16)
    free = LLM(args.model, **common, kv_cache_memory=args.free_memory)
    prompts = prompts_of(free, text, args.requests, args.prompt)
    stats = free.engine.kv_cache_stats()
    needed = args.requests * free.engine.kv_plan.blocks_per_sequence(length)   # every group
    memory = int(needed / args.overload * stats.bytes_per_block)
    seconds, reference = generate(free, prompts, args.max_tokens)
    base = {"seconds": round(seconds, 2),
            "tok_s": round(sum(map(len, reference)) / seconds, 2),
            "ppl": round(perplexity(free, prompts, reference), 4)}
    print(json.dumps({"unpressured": base}), flush=True)
    engines = {mode: LLM(args.model, **common, kv_cache_memory=memory, kv_pressure=mode)
               for mode in ("preempt", "demote")}
    runs = {mode: [] for mode in engines}
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            llm.engine.block_manager.reset_prefix_cache()     # each run starts cold
            runs[mode].append(run_mode(llm, prompts, args.max_tokens, reference, free))
            print(json.dumps({mode: runs[mode][-1]}), flush=True)
    rate = {m: sum(r["tok_s"] for r in rs) / len(rs) for m, rs in runs.items()}
    ppl = runs["demote"][0]["ppl"]
    return {"model": args.model or "default", "requests": args.requests,
            "prompt_tokens": args.prompt, "max_tokens": args.max_tokens,
            "overload": args.overload, "kv_cache_memory": memory,
            "blocks": {m: e.engine.kv_cache_stats().num_blocks for m, e in engines.items()},
            "blocks_needed": needed, "threads": torch.get_num_threads(),
            "unpressured": base, "runs": runs,
            "demote_over_preempt": round(rate["demote"] / rate["preempt"], 3),
            "demote_ppl_over_unpressured": round(ppl / base["ppl"], 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--overload", type=float, default=2.0,
                   help="the blocks the requests need over the blocks the pool holds")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--free-memory", default="2GiB", help="the unpressured run's KV memory")
    p.add_argument("--data", default="../shared/corpus/test.txt")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
