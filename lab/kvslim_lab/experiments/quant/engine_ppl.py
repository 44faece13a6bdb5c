"""Perplexity through the serving engine (prompt logprobs), for what `kvslim ppl` cannot see: the
KV cache. Prefill attention reads the K/V the cache gives back (`attention/kv_cache.py`), so an
int8 cache's rounding is in every score. Windows of `context` tokens side by side, each scoring
all its tokens but the first: the tokens and contexts of `kvslim ppl --stride CONTEXT`."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvslim_lab.bench.runners import kvslim_llm
from kvslim.engine.sampling_params import SamplingParams


@dataclass
class EnginePerplexity:
    perplexity: float
    num_tokens: int
    kv_cache_dtype: str

    def to_dict(self) -> dict:
        return asdict(self)


def engine_perplexity(model_dir, tokens, context: int, kv_cache_dtype: str = "auto",
                      max_num_seqs: int = 8) -> EnginePerplexity:
    ids = [int(t) for t in tokens]
    prompts = [ids[i:i + context] for i in range(0, len(ids), context)]
    prompts = [p for p in prompts if len(p) > 1]
    llm = kvslim_llm(model_dir, "256MiB", max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max(2048, context), kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    nll = [-t.logprob for o in outs for t in o.prompt_logprobs[1:]]
    return EnginePerplexity(math.exp(sum(nll) / len(nll)), len(nll), kv_cache_dtype)
