"""Self-speculation from the slim cache (speculative method "self": the target drafts over
sinks + a window of its context, verifies against the full cache) against plain decoding, at
batch 1 on long prompts of held-out text: per context, the decode rate of each (new tokens
after the second over the time they took, so that the prefill and the draft's catch-up on the
prompt stay out), whether the tokens are identical, and the acceptance.

    python benchmarks/self_speculation.py [--model NAME] [--contexts 1024 4096 8192]
        [--window 256] [--sinks 4] [--k 3] [--max-tokens 64] [--threads 2] [--json]
        [--out docs/kv_budget/self_speculation.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvslim import LLM, SamplingParams


def prompt_of(llm: LLM, text: str, tokens: int) -> list[int]:
    ids = llm.tokenizer.encode(text)
    if len(ids) < tokens:
        raise SystemExit(f"the text holds {len(ids)} tokens, {tokens} needed")
    return ids[:tokens]


def decode_rate(llm: LLM, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """Tokens/s of the decode steps after the one that drew the second token (the prompt's
    prefill chunks, and the first decode step, in which a self-drafter's cache catches up on
    the prompt, stay out), stepping the engine and timing each step."""
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    steps, ids = [], []
    while eng.has_unfinished_requests():
        start = time.perf_counter()
        outs = eng.step()
        seconds = time.perf_counter() - start
        for out in outs:
            ids += out.outputs[0].delta_token_ids
        steps.append((seconds, len(ids)))
    # from the step after the one that drew the second token (a long prompt prefills in
    # several chunk steps first)
    second = next(i for i, (_, n) in enumerate(steps) if n >= 2)
    timed = steps[second + 1:]
    tokens = steps[-1][1] - steps[second][1]
    return tokens / max(sum(s for s, _ in timed), 1e-9), ids


def measure(args) -> dict:
    text = Path(args.data).read_text(encoding="utf-8", errors="replace")
    common = dict(kv_cache_memory=args.kv_cache_memory, max_num_seqs=1,
                  enable_prefix_caching=False, max_model_len=max(args.contexts) + args.max_tokens)
    plain = LLM(args.model, **common)
    fast = LLM(args.model, **common, speculative={
        "method": "self", "num_speculative_tokens": args.k, "kv_window": args.window,
        "kv_sink_tokens": args.sinks})
    rows = []
    for context in args.contexts:
        prompt = prompt_of(plain, text, context)
        decode_rate(fast, prompt[:64], 8)                  # warm-up
        fast.engine.spec.reset_stats()
        base, base_ids = decode_rate(plain, prompt, args.max_tokens)
        spec, spec_ids = decode_rate(fast, prompt, args.max_tokens)
        again, _ = decode_rate(plain, prompt, args.max_tokens)       # A B A: drift shows
        stats = fast.engine.spec.stats
        rows.append({"context": context, "plain_tok_s": round((base + again) / 2, 2),
                     "plain_runs": [round(base, 2), round(again, 2)],
                     "self_tok_s": round(spec, 2), "speedup": round(2 * spec / (base + again), 3),
                     "identical": spec_ids == base_ids,
                     "acceptance": round(stats.num_accepted_tokens
                                         / max(stats.num_draft_tokens, 1), 3)})
        print(json.dumps(rows[-1]), flush=True)
    return {"model": args.model or "default", "window": args.window, "sinks": args.sinks,
            "k": args.k, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
            "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8000])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="2GiB")
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
