"""Int8 (or fp8) KV cache against the model-dtype cache on one model, through the paged engine:
perplexity from prompt logprobs over windows of a corpus, and batch-1 decode speed measured in
interleaved rounds (medians).

    python benchmarks/kv_cache_quality.py --model DIR --corpus FILE --json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams


def windows(llm: LLM, corpus: str, num: int, length: int) -> list[list[int]]:
    ids = llm.tokenizer.encode(open(corpus, encoding="utf-8").read())
    step = max(length, (len(ids) - length) // max(1, num - 1))
    out = [ids[i:i + length] for i in range(0, len(ids) - length + 1, step)][:num]
    if len(out) < num:
        raise SystemExit(f"{corpus}: {len(ids)} tokens hold only {len(out)} windows of {length}")
    return out


def perplexity(llm: LLM, prompts: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    nll = [-t.logprob for o in outs for t in o.prompt_logprobs[1:]]
    mean = sum(nll) / len(nll)
    return {"perplexity": math.exp(mean), "nll": mean, "num_tokens": len(nll)}


def decode_ms_per_token(llm: LLM, prompt: list[int], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:16]], SamplingParams(max_tokens=1), use_tqdm=False)   # warm
    m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
    return (m.finished_time - m.first_token_time) * 1000 / (new - 1)   # decode steps only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--kv-cache-dtypes", default="auto,int8")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.kv_cache_dtypes.split(",")
    llms = {d: LLM(args.model, device="cpu", kv_cache_memory="256MiB", max_num_seqs=16,
                   kv_cache_dtype=d) for d in dtypes}
    prompts = windows(llms[dtypes[0]], args.corpus, args.windows, args.window_len)
    result = {d: {"ppl": perplexity(llm, prompts),
                  "blocks": llm.kv_cache_stats().num_blocks,
                  "bytes_per_token": llm.kv_cache_stats().bytes_per_token}
              for d, llm in llms.items()}
    times = {d: [] for d in dtypes}
    for _ in range(args.rounds):                       # engines take turns within each round
        for d, llm in llms.items():
            times[d].append(decode_ms_per_token(llm, prompts[0][:args.prompt_len],
                                                args.new_tokens))
    for d in dtypes:
        result[d]["decode_ms_per_token"] = {"median": statistics.median(times[d]),
                                            "all": [round(t, 2) for t in times[d]]}
    result["settings"] = vars(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for d in dtypes:
        r = result[d]
        print(f"{d:>9}: ppl {r['ppl']['perplexity']:.4f} over {r['ppl']['num_tokens']} tokens, "
              f"{r['bytes_per_token']} B/token, {r['blocks']} blocks, batch-1 decode "
              f"{r['decode_ms_per_token']['median']:.1f} ms/token (median)")


if __name__ == "__main__":
    main()
