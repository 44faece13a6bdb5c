"""A dropped engine lets go of everything at once: no reference cycle keeps an `LLM` (its KV
pool, its model, its tensor-parallel ranks) alive until the cycle collector happens to run. The
collector is switched off in these tests, so a cycle would show as a live weak reference."""
import gc
import weakref

import psutil
import pytest

from engine_helpers import GREEDY
from kvslim import LLM
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.speculative.config import SpeculativeConfig

PROMPT = list(range(10, 30))


@pytest.fixture
def no_collector():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


def used_then_dropped(path, params, **options) -> dict[str, weakref.ref]:
    """Weak references to an LLM's parts, taken after it ran `params` and was dropped."""
    llm = LLM(str(path), kv_cache_memory="2MiB", dtype="float32", device="cpu", **options)
    llm.generate([PROMPT, PROMPT[:5]], params, use_tqdm=False)
    engine = llm.engine
    refs = {"llm": weakref.ref(llm), "engine": weakref.ref(engine),
            "model": weakref.ref(engine.model), "runner": weakref.ref(engine.runner),
            "kv_cache": weakref.ref(engine.runner.kv_cache[0]),
            "scheduler": weakref.ref(engine.scheduler)}
    del llm, engine
    return refs


@pytest.mark.parametrize("case", ["greedy", "beam_search", "ngram", "sampled"])
def test_a_dropped_llm_is_freed_without_the_collector(hf_checkpoints, no_collector, case):
    params = SamplingParams(max_tokens=6, **GREEDY)
    options = {}
    if case == "beam_search":
        params = SamplingParams(max_tokens=6, n=2, use_beam_search=True, ignore_eos=True)
    elif case == "ngram":
        options["speculative"] = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    elif case == "sampled":
        params = SamplingParams(max_tokens=6, temperature=0.8, seed=1, presence_penalty=0.5,
                                ignore_eos=True)
    refs = used_then_dropped(hf_checkpoints["gqa"], params, **options)
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert alive == []


def test_memory_stays_flat_over_create_drop_cycles(hf_checkpoints, no_collector):
    """Five engines with 64 MiB pools made and dropped in turn: the process holds about one."""
    params = SamplingParams(max_tokens=4, **GREEDY)

    def cycle() -> float:
        llm = LLM(str(hf_checkpoints["gqa"]), kv_cache_memory="64MiB", dtype="float32",
                  device="cpu")
        llm.engine.runner.kv_cache[0].fill_(1.0)          # touch the pool: resident pages
        llm.generate([PROMPT], params, use_tqdm=False)
        del llm
        return psutil.Process().memory_info().rss

    first = cycle()
    later = [cycle() for _ in range(4)]
    assert max(later) <= first * 1.10, (first, later)


def test_tensor_parallel_engines_one_after_another(hf_checkpoints, no_collector):
    """Dropped without shutdown(), a tensor-parallel LLM frees its ranks and process group:
    the next one in the same process starts."""
    path = hf_checkpoints["gqa"]
    params = SamplingParams(max_tokens=5, **GREEDY)
    answers = []
    for _ in range(2):
        llm = LLM(str(path), kv_cache_memory="1MiB", dtype="float32", device="cpu",
                  tensor_parallel_size=2, tensor_parallel_oversubscribe=True)
        workers = llm.engine.parallel.processes
        answers.append(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
        for p in workers:
            p.join(timeout=30)
        assert [p.exitcode for p in workers] == [0]
    assert answers[0] == answers[1]
