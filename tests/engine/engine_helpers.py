"""Shared by the engine tests: build an engine on a test checkpoint and run requests to the end."""
from __future__ import annotations

import pytest
import torch

from checkpoints import VOCAB
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.kernels import extension

GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine(path, **config) -> LLMEngine:
    config.setdefault("kv_cache_memory", "8MiB")
    return LLMEngine(path, EngineConfig(dtype="float32", device="cpu", **config))


def prompts_of(lengths, seed: int = 0, prefix=()) -> list[list[int]]:
    """Random prompts of these lengths (token ids < VOCAB), each after `prefix`."""
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(eng: LLMEngine, prompts, params: SamplingParams | list[SamplingParams]) -> list:
    """Add all prompts, step until done; returns final RequestOutputs in prompt order and checks
    that no block is left in use."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert eng.kv_cache_stats().num_used_blocks == 0, "blocks leaked"
    return [done[i] for i in ids]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_greedy(hf_model, prompts, max_new_tokens) -> list[list[int]]:
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


# The kernel attention backend is kvslim's C++ decode kernel: without the extension the engine
# refuses it (test_attention_backends checks the message), so the runs that name it skip.
NO_KERNELS = extension.disabled() or extension.missing_compiler() is not None
needs_kernels = pytest.mark.skipif(NO_KERNELS, reason="the kernel backend needs kvslim's extension")
