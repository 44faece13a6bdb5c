"""On a CUDA machine: decode with CUDA graphs against the eager engine on the same model.

    python benchmarks/cuda_decode_check.py [MODEL_DIR] [--dtype float32]

Greedy tokens must be identical with and without graphs (exit 1 otherwise); prints decode
tokens/s of both at batch 1 and 16. Without MODEL_DIR it uses the embedded default model."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams


def decode_rate(llm: LLM, prompts, params) -> tuple[list[list[int]], float]:
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return [o.outputs[0].token_ids for o in outs], generated / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available on this machine", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [list(range(100 + i, 164 + i)) for i in range(16)]
    engines = {mode: LLM(args.model, dtype=args.dtype, device="cuda", kv_cache_memory="2GiB",
                         max_num_seqs=16, enforce_eager=(mode == "eager"))
               for mode in ("eager", "graphs")}
    failed = False
    for batch in (1, 16):
        results = {m: decode_rate(llm, prompts[:batch], params) for m, llm in engines.items()}
        same = results["eager"][0] == results["graphs"][0]
        failed |= not same
        print(f"batch {batch:2d}: eager {results['eager'][1]:8.1f} tok/s, graphs "
              f"{results['graphs'][1]:8.1f} tok/s, tokens identical: {same}")
    print(f"graphs captured: {sorted(engines['graphs'].engine.runner.decode_graphs.graphs)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
