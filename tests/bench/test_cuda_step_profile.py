"""benchmarks/cuda_step_profile.py on the CPU: the prepared GPU check's step timing and profile
run here as they will there (host side only), and leave the engine as they found it."""
import sys
from pathlib import Path

import pytest

from kvslim import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cuda_step_profile import (PHASES, decode_step_times, phases_marked,  # noqa: E402
                               profile_decode, step_summary)


@pytest.fixture(scope="module")
def llm(hf_checkpoints):
    engine = LLM(str(hf_checkpoints["gqa"]), kv_cache_memory="4MiB", max_num_seqs=4,
                 max_model_len=128, enforce_eager=True)
    engine.engine.runner.enable_padded_decode()        # the decode graphs' path, eagerly
    return engine


def test_every_decode_step_is_timed(llm):
    times = decode_step_times(llm, [1, 2, 3, 4], 6, "cpu")
    assert len(times) == 5 and all(t > 0 for t in times)
    summary = step_summary(times)
    assert summary["steps_timed"] == 5
    assert summary["step_ms_p10"] <= summary["step_ms_median"] <= summary["step_ms_p90"]
    assert not llm.engine.has_unfinished_requests()


def test_the_profile_sees_every_phase_of_a_decode_step(llm, tmp_path):
    trace = tmp_path / "trace.json"
    summary = profile_decode(llm, [5, 6, 7], 4, "cpu", trace)
    assert summary["steps"] == 4 and trace.stat().st_size > 0
    host = summary["host_ms_per_step"]
    assert set(host) == set(PHASES) and all(host[p] > 0 for p in PHASES)
    assert host["graph"] < summary["wall_ms_per_step"]
    assert "device_busy_ms_per_step" not in summary and summary["note"]


def test_marking_leaves_the_engine_as_it_was(llm):
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    sampler = runner.sampler
    with phases_marked(llm):
        assert runner.sampler is not sampler and "_prepare" in vars(runner)
    assert runner.sampler is sampler
    assert "_prepare" not in vars(runner) and "schedule" not in vars(scheduler)
    assert "run" not in vars(runner.decode_graphs)
