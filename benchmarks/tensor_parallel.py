"""Tensor parallelism, measured: per-rank memory and step time at N = 1, 2 (or more), one model
after another, in one run, on the same prompt tokens.

For each degree the engine starts its ranks, and the script reports what each rank allocated
(KV bytes per token and blocks, from the ranks themselves; weight bytes of rank 0's shard), the
planner's per-rank figures (`kvslim memory --tensor-parallel-size N`), the median prefill and
decode step times of one batch, and whether the greedy tokens equal N = 1's.

    python benchmarks/tensor_parallel.py --models models/ref-mha gemma3-270m --degrees 1 2 --json

The default models show both sides of the GQA point: the reference MHA model (8 KV heads) splits
its KV heads, so a rank's cache halves at N = 2; Gemma 3 270M (MQA, one KV head) must replicate
its head, so a rank's cache does not shrink at all. `--quantized` takes a GGUF model's quantized
import instead (its linear layers and token embeddings stay in their blocks and each rank holds
its slice of them), e.g. SmolLM2-135M's Q4_1 file, whose 9 query and 3 KV heads split at N = 3:

    python benchmarks/tensor_parallel.py --models default --degrees 1 3 --quantized --oversubscribe
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.formats.registry import resolve_model
from kvslim.models.config import ModelConfig
from kvslim.parallel.memory import tensor_parallel_memory


def shard_weight_bytes(engine: LLMEngine) -> int:
    """Rank 0's resident weights (its shard; every rank holds the same)."""
    tensors = list(engine.model.parameters()) + list(engine.model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def run_degree(model_dir, degree: int, prompts: list[list[int]], args) -> dict:
    config = EngineConfig(dtype="float32", device="cpu", tensor_parallel_size=degree,
                          kv_cache_memory=args.kv_cache_memory,
                          tensor_parallel_oversubscribe=degree > 1 and args.oversubscribe)
    engine = LLMEngine(model_dir, config)
    try:
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        prefill, decode, outs = [], [], {}
        while engine.has_unfinished_requests():
            decoding = all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running) \
                and bool(engine.scheduler.running)
            start = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
            (decode if decoding else prefill).append(time.perf_counter() - start)
        ranks = engine.rank_kv_stats()
        decode.sort()
        return {"degree": degree, "tokens": [outs[k] for k in sorted(outs, key=_req_index)],
                "prompt_logprobs": prompt_logprobs(engine, prompts),
                "weight_bytes_rank0": shard_weight_bytes(engine),
                "kv_bytes_per_token_per_rank": [r.kv_bytes_per_token for r in ranks],
                "num_blocks_per_rank": [r.num_blocks for r in ranks],
                "prefill_s": round(sum(prefill), 3),
                "decode_step_ms_median": round(1000 * decode[len(decode) // 2], 2),
                "decode_tok_s": round(len(prompts) * len(decode) / sum(decode), 1)}
    finally:
        engine.shutdown()


def prompt_logprobs(engine: LLMEngine, prompts: list[list[int]]) -> list[float]:
    """Every prompt token's logprob (the first of each prompt excepted), in prompt order: how
    far the ranks' logits are from one rank's, through the engine."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=1, prompt_logprobs=0))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [e.logprob for e in out.prompt_logprobs[1:]]
    return [x for k in sorted(outs, key=_req_index) for x in outs[k]]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _req_index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[-1])


def measure(args) -> dict:
    rows = []
    for name in args.models:
        model_dir = resolve_model(name, quantized=args.quantized)
        spec = ModelConfig.from_dir(model_dir)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, spec.vocab_size, (args.input_len,), generator=g).tolist()
                   for _ in range(args.batch)]
        base = None
        for n in args.degrees:
            print(f"{name}: tensor_parallel_size {n} ...", file=sys.stderr, flush=True)
            r = run_degree(model_dir, n, prompts, args)
            plan = tensor_parallel_memory(spec, n, "fp32", "fp32") if n > 1 else None
            base = base or r
            drift = max(abs(x - y) for x, y in zip(r["prompt_logprobs"],
                                                   base["prompt_logprobs"]))
            prefix = [common_prefix(a, b) for a, b in zip(r["tokens"], base["tokens"])]
            rows.append({"model": name, **{k: v for k, v in r.items()
                                           if k not in ("tokens", "prompt_logprobs")},
                         "same_tokens_as_n1": r["tokens"] == base["tokens"],
                         # greedy tokens before the first that differs from N = 1's, mean
                         "tokens_before_divergence": sum(prefix) / len(prefix),
                         "max_prompt_logprob_diff_vs_n1": float(f"{drift:.3g}"),
                         "planner_kv_bytes_per_token": (plan.kv_bytes_per_token if plan
                                                        else spec.kv_cache_bytes_per_token(
                                                            torch.float32)),
                         "kv_replicated": bool(plan and plan.replicated)})
    return {"batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
            "threads": torch.get_num_threads(), "quantized": args.quantized, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"Batch of {result['batch']} prompts of {result['input_len']} tokens, "
             f"{result['output_len']} greedy tokens each, "
             f"{'GGUF blocks kept, ' if result.get('quantized') else ''}float32 on CPU "
             f"({result['threads']} threads in all, split between the ranks):", "",
             "| model | N | weights per rank | KV bytes/token per rank (planner) | KV heads "
             "| prefill s | decode step ms | decode tok/s | tokens = N 1 (mean equal prefix) "
             "| max prompt logprob diff |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        kv = r["kv_bytes_per_token_per_rank"][0]
        heads = "replicated" if r["kv_replicated"] else ("split" if r["degree"] > 1 else "all")
        lines.append(f"| {r['model']} | {r['degree']} | {r['weight_bytes_rank0'] / 2**20:.1f} MiB"
                     f" | {kv:,} ({r['planner_kv_bytes_per_token']:,}) | {heads} | "
                     f"{r['prefill_s']} | {r['decode_step_ms_median']} | {r['decode_tok_s']} | "
                     f"{r['same_tokens_as_n1']} ({r['tokens_before_divergence']:.1f} of "
                     f"{result['output_len']}) | {r['max_prompt_logprob_diff_vs_n1']:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["models/ref-mha", "gemma3-270m"])
    p.add_argument("--degrees", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per rank")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than CPU cores (--tensor-parallel-oversubscribe)")
    p.add_argument("--quantized", action="store_true",
                   help="GGUF models: the quantized import (blocks kept), not the float32 one")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else markdown(result))
    return 0 if all(r["same_tokens_as_n1"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
