"""The runner keeps its per-sequence state in its own objects: executing steps (prefill
chunks, decodes, a preemption's recompute, n > 1 forks) never writes a Sequence."""
import pytest

from engine_helpers import GREEDY, engine, prompts_of, run
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.sequence import Sequence


@pytest.mark.parametrize("kv_cache_memory", ["8MiB", "24KiB"])      # 24 KiB: 6 blocks, preempts
def test_executing_a_step_writes_no_sequence(hf_checkpoints, monkeypatch, kv_cache_memory):
    eng = engine(hf_checkpoints["gqa"], kv_cache_memory=kv_cache_memory,
                 max_num_batched_tokens=32)
    writes, steps = [], []
    original_setattr, execute = Sequence.__setattr__, eng.executor.execute

    def recording(self, name, value):
        writes.append(name)
        original_setattr(self, name, value)

    def watched_execute(*args, **kwargs):
        monkeypatch.setattr(Sequence, "__setattr__", recording)
        try:
            return execute(*args, **kwargs)
        finally:
            monkeypatch.setattr(Sequence, "__setattr__", original_setattr)
            steps.append(1)

    monkeypatch.setattr(eng.executor, "execute", watched_execute)
    prompts = prompts_of([40, 7, 23]) + prompts_of([9], seed=1)
    params = [SamplingParams(max_tokens=12, **GREEDY)] * 3 + [
        SamplingParams(max_tokens=6, n=2, seed=0)]
    run(eng, prompts, params)
    assert len(steps) > 10 and writes == []
    assert (eng.scheduler.num_preemptions > 0) == (kv_cache_memory == "24KiB")
