"""Tensor-parallel ranks start and end with the engine: a worker killed mid-generation fails
every open request within seconds and leaves no process behind; a model no rank can load fails
on every rank with its one-line error; a normal shutdown lets each worker exit cleanly; and 4
ranks (more than the 2 cores CI has: the override) give one rank's tokens.

Each test starts its own ranks: the engines of tests/engine/test_tensor_parallel.py are gone by
then (one tensor-parallel engine per process at a time)."""
import itertools
import json
import os
import shutil
import signal
import time

import pytest
import torch

from engine_helpers import GREEDY, run, tokens
from kvslim import LLM
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.parallel_executor import TensorParallelExecutor
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import EngineFailedError, WeightsError
from kvslim.models.config import ModelConfig
from kvslim.parallel.memory import tensor_parallel_memory

COMMON = dict(dtype="float32", device="cpu", tensor_parallel_oversubscribe=True)
PROMPT = list(range(10, 30))


def running(pid: int) -> bool:
    """The process exists and is not a zombie (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_worker_fails_every_open_request(hf_checkpoints):
    llm = LLM(str(hf_checkpoints["gqa"]), kv_cache_memory="1MiB", tensor_parallel_size=2,
              distributed_timeout=20, **COMMON)
    engine = llm.engine
    pids = engine.parallel.worker_pids()
    step, calls = engine.step, itertools.count()

    def step_then_kill():                  # the fourth step starts with rank 1 dead
        if next(calls) == 3:
            os.kill(pids[0], signal.SIGKILL)
        return step()

    engine.step = step_then_kill
    start = time.monotonic()
    with pytest.raises(EngineFailedError, match=r"tensor-parallel rank 1 \(pid \d+\) was killed"
                                                r" by SIGKILL"):
        llm.generate([PROMPT] * 3, SamplingParams(max_tokens=200, **GREEDY), use_tqdm=False)
    assert time.monotonic() - start < 30
    assert next(calls) == 4                # it failed at once, not after more steps
    assert not engine.has_unfinished_requests()             # generate aborted every request
    assert not any(running(pid) for pid in pids)
    engine.add_request(PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(EngineFailedError, match="have been shut down"):
        step()
    llm.shutdown()                                           # idempotent


def test_a_model_no_rank_can_load_fails_on_every_rank(hf_checkpoints, tmp_path, monkeypatch):
    path = tmp_path / "model"
    shutil.copytree(hf_checkpoints["gqa"], path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 64              # the checkpoint's MLP weights are 128 wide
    (path / "config.json").write_text(json.dumps(config))
    ended = []
    shutdown = TensorParallelExecutor.shutdown

    def recording_shutdown(self):
        ended.append(list(self.processes))
        shutdown(self)

    monkeypatch.setattr(TensorParallelExecutor, "shutdown", recording_shutdown)
    start = time.monotonic()
    with pytest.raises(WeightsError, match="has shape"):
        LLMEngine(path, EngineConfig(**COMMON, tensor_parallel_size=2))
    assert time.monotonic() - start < 60
    (workers,) = ended
    assert [p.exitcode for p in workers] == [2]   # it failed too, and left rank 0 the message
    assert not any(running(p.pid) for p in workers)


def test_four_ranks_match_one_and_exit_cleanly(hf_checkpoints):
    """GQA's 2 KV heads over 4 ranks: each head on two ranks, 2 query heads per rank."""
    path = hf_checkpoints["gqa"]
    config = ModelConfig.from_dir(path)
    per_token = {n: tensor_parallel_memory(config, n).kv_bytes_per_token for n in (1, 4)}
    prompts = [PROMPT, PROMPT[:7], list(range(40, 75))]
    params = SamplingParams(max_tokens=10, **GREEDY)
    threads = torch.get_num_threads()
    one = LLMEngine(path, EngineConfig(**COMMON, kv_cache_memory=64 * 16 * per_token[1],
                                       max_num_batched_tokens=16))
    tp = LLMEngine(path, EngineConfig(**COMMON, kv_cache_memory=64 * 16 * per_token[4],
                                      max_num_batched_tokens=16, tensor_parallel_size=4))
    try:
        assert tokens(run(tp, prompts, params)) == tokens(run(one, prompts, params))
        stats = tp.rank_kv_stats()
        assert [s.rank for s in stats] == [0, 1, 2, 3]
        assert {(s.num_blocks, s.kv_slot_bytes) for s in stats} == {(64, per_token[4])}
        assert per_token[4] == per_token[1] // 2      # one of the 2 KV heads per rank
        assert torch.get_num_threads() == 1           # each rank's share of the threads
    finally:
        tp.shutdown()
    workers = tp.parallel.processes
    assert [p.exitcode for p in workers] == [0, 0, 0]   # left on the stop message
    assert torch.get_num_threads() == threads           # given back
