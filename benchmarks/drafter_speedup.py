"""A learned drafter (Medusa heads or an EAGLE head, `kvslim train-drafter`) against plain
decoding on free chat answers: the speculative study's sixteen questions (none of them in
benchmarks/drafter_prompts.py's training prompts), greedy, at batch 1 (one request at a time)
and at batch 8; per run the wall time, the tokens, whether every answer equals plain decoding's
token for token, the mean accepted length and the acceptance at each draft position.

    python benchmarks/drafter_speedup.py DRAFTER_DIR [--model NAME] [--k 1 2 3] [--max-tokens 64]
        [--batches 1 8] [--adaptive] [--threads 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from kvslim import LLM, SamplingParams
from kvslim.drafters.kind import drafter_kind
from kvslim_lab.experiments.speculative.workloads import QUESTIONS


def timed(llm: LLM, conversations, params, batch: int) -> tuple[float, list[list[int]]]:
    start, answers = time.perf_counter(), []
    for i in range(0, len(conversations), batch):
        outs = llm.chat(conversations[i:i + batch], params, use_tqdm=False)
        answers += [o.outputs[0].token_ids for o in outs]
    return time.perf_counter() - start, answers


def spec_row(llm: LLM, label: str, conversations, params, batch: int, base_s: float,
             expected) -> dict:
    """One speculating engine's run, its warm-up's counts left out."""
    timed(llm, conversations[:2], params, batch)
    llm.engine.spec.reset_stats()
    seconds, answers = timed(llm, conversations, params, batch)
    stats = llm.engine.spec.stats
    tree = {} if not stats.accepted_per_node else {
        "verifications": stats.num_verifications, "accepted_per_node": stats.accepted_per_node,
        "accepted_off_chain": stats.num_accepted_off_chain}
    return tree | {"batch": batch, "method": label, "seconds": round(seconds, 2),
            "tokens": sum(map(len, answers)), "identical": answers == expected,
            "speedup": round(base_s / seconds, 3),
            "mean_accepted_length": round(stats.mean_accepted_length, 3),
            "acceptance_per_position": [round(a, 3) for a in stats.acceptance_rate_per_position],
            "propose_ms": round(1e3 * stats.propose_seconds / max(1, stats.num_proposals), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter")
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--adaptive", action="store_true",
                    help="also each k with the engine's adaptive defaults (speculation off "
                         "above disable_by_batch_size)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    method = drafter_kind(args.drafter)
    plain = LLM(args.model, kv_cache_memory="512MiB")
    arms = [(k, forced) for k in args.k for forced in ([True, False] if args.adaptive else [True])]
    rows, bar = [], tqdm(total=len(args.batches) * (1 + len(arms)), desc="runs")
    for batch in args.batches:
        timed(plain, conversations[:2], params, batch)                 # warm-up
        base_s, expected = timed(plain, conversations, params, batch)
        rows.append({"batch": batch, "method": "plain", "seconds": round(base_s, 2),
                     "tokens": sum(map(len, expected))})
        bar.update()
        for k, forced in arms:
            spec = {"method": method, "model": args.drafter, "num_speculative_tokens": k}
            llm = LLM(args.model, kv_cache_memory="512MiB",
                      speculative=spec | ({"disable_by_batch_size": None} if forced else {}))
            label = f"{method} k={k}" + ("" if forced else " adaptive")
            rows.append(spec_row(llm, label, conversations, params, batch, base_s, expected))
            bar.update()
    bar.close()
    if args.json:
        print(json.dumps({"drafter": args.drafter, "method": method,
                          "max_tokens": args.max_tokens, "rows": rows}))
        return
    print("| batch | method | s | tokens | identical | speedup | mean accepted | per position "
          "| ms / proposal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['method']} | {r['seconds']} | {r['tokens']} | "
              f"{r.get('identical', '')} | {r.get('speedup', '')} | "
              f"{r.get('mean_accepted_length', '')} | {r.get('acceptance_per_position', '')} | "
              f"{r.get('propose_ms', '')} |")


if __name__ == "__main__":
    main()
