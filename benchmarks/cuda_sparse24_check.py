"""Semi-structured 2:4 sparse linears on CUDA (`cuda_sparse_24`) against the dense kernels, on
the random ~1B Llama of cuda_decode_check.py pruned 2:4 by magnitude (bfloat16):

    python benchmarks/cuda_sparse24_check.py --out docs/cuda_sparse24_check.json
    python benchmarks/cuda_decode_check.py --sparse24 ...     # the same, inside the GPU check

For each engine: prefill tokens/s (prompts of 512 tokens, one generated), batch-1 decode
tokens/s, offline throughput (64 x 128 tokens in, 128 out), and whether the greedy tokens of a
mixed batch equal the dense engine's. This says whether the option should be on by default on
the GPU measured (layers/cuda_sparse24.py). Without CUDA it writes why it did not run."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from cuda_check_common import (FULL, LLAMA_1B, LLAMA_SMOKE, SMOKE, check_main,
                               count_equal_to_first, random_llama, release, timed)
from cuda_step_profile import decode_step_times, greedy, step_summary
from kvslim_lab.bench.workload import Workload, special_ids
from kvslim.engine.llm import LLM
from kvslim.formats.registry import default_model_dir
from kvslim.surgery.prune.masks import SparsityTarget
from kvslim.surgery.prune.model import prune_model
from kvslim.tokenizer.tokenizer import Tokenizer

PREFILL_LEN = 512


def measure(model_dir: Path, sparse: bool, plan: dict, prompts, long_prompts, check) -> dict:
    llm, startup = timed("cuda", lambda: LLM(
        str(model_dir), dtype="bfloat16", device="cuda", kv_cache_memory=plan["kv_cache"],
        max_num_seqs=plan["batch"], max_model_len=max(plan["max_model_len"], 2 * PREFILL_LEN),
        max_num_batched_tokens=8192, enable_prefix_caching=False, cuda_sparse_24=sparse))
    n = plan["new_tokens"]
    tokens = [o.outputs[0].token_ids for o in llm.generate(check, greedy(n), use_tqdm=False)]
    llm.generate(long_prompts, greedy(1), use_tqdm=False)                  # warm-up,
    llm.generate(prompts[:1], greedy(4), use_tqdm=False)                   # every timed shape
    _, prefill_s = timed("cuda", lambda: llm.generate(long_prompts, greedy(1), use_tqdm=False))
    rate = step_summary(decode_step_times(llm, prompts[0], n, "cuda"))
    _, batch_s = timed("cuda", lambda: llm.generate(prompts, greedy(n), use_tqdm=False))
    out = {"cuda_sparse_24": sparse, "startup_s": round(startup, 1), "tokens": tokens,
           "prefill_tok_s": round(len(long_prompts) * PREFILL_LEN / prefill_s, 1),
           "decode_tok_s": rate["decode_tok_s"], "step_ms_median": rate["step_ms_median"],
           "throughput_tok_s": round(len(prompts) * n / batch_s, 1)}
    del llm
    release("cuda")
    return out


def check_sparse24(smoke: bool = False, tokenizer_dir: Path | None = None) -> dict:
    """Dense against sparse engines on the pruned model; {"skipped": why} without CUDA.
    `tokenizer_dir`: the tokenizer the random Llama takes (default: SmolLM2's import)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    plan = SMOKE if smoke else FULL
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dense = random_llama(tokenizer_dir or default_model_dir(show_progress=False),
                             LLAMA_SMOKE if smoke else LLAMA_1B, "cuda", root / "dense")
        pruned = prune_model(dense, root / "p24", "magnitude", SparsityTarget(n=2, m=4),
                             show_progress=False)
        vocab = json.loads((pruned / "config.json").read_text())["vocab_size"]
        avoid = special_ids(Tokenizer.from_dir(pruned))
        prompts = Workload(plan["batch"], plan["prompt_len"], 0, seed=1).prompts(vocab, avoid)
        long_prompts = Workload(16, PREFILL_LEN, 0, seed=2).prompts(vocab, avoid)
        check = [p[:max(1, len(p) * (i + 1) // plan["check_prompts"])]
                 for i, p in enumerate(prompts[:plan["check_prompts"]])]
        entries = []
        for sparse in (False, True):
            try:
                entries.append(measure(pruned, sparse, plan, prompts, long_prompts, check))
            except Exception as e:                 # the dense numbers survive a sparse failure
                entries.append({"cuda_sparse_24": sparse, "error": f"{type(e).__name__}: {e}"})
    count_equal_to_first(entries, "tokens_equal_dense")
    return {"model": "llama-tiny" if smoke else "llama-1B-random, 2:4 magnitude",
            "device": torch.cuda.get_device_name(), "engines": entries}


if __name__ == "__main__":
    sys.exit(check_main(check_sparse24, __doc__.splitlines()[0]))
