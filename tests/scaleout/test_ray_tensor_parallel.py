"""A replica split over 2 tensor-parallel ranks that are 2 Ray workers (kvslim.scaleout.ranks):
`kvslim serve --ray-address local --tensor-parallel-size 2` on one machine, gloo between the
ranks, rendezvous at rank 0's address. Greedy answers equal one engine's; rank 1 is a Ray
actor of its own; stopping the server ends every rank and Ray process."""
from __future__ import annotations

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the replicas run on Ray: pip install 'kvslim[ray]'")
psutil = pytest.importorskip("psutil")

from checkpoints import write_checkpoint  # noqa: E402
from live_server import LiveServer  # noqa: E402

from kvslim.engine.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["It is a truth universally acknowledged, that", "The kernel schedules tasks;"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint("gqa", tmp_path_factory.mktemp("tp") / "gqa")


def test_two_ranks_as_ray_workers_answer_as_one_engine(tiny, tmp_path_factory):
    from kvslim.engine.llm import LLM
    with LLM(str(tiny), dtype="float32", device="cpu", kv_cache_memory="2MiB") as llm:
        expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12),
                                use_tqdm=False)
    log = tmp_path_factory.mktemp("tp-logs") / "serve.log"
    server = LiveServer(tiny, log, "--ray-address", "local", "--tensor-parallel-size", "2",
                        "--tensor-parallel-oversubscribe", "--kv-cache-memory", "1MiB")
    try:
        server.wait_healthy(timeout=240)
        processes = psutil.Process(server.process.pid).children(recursive=True)
        titles = [" ".join(p.cmdline()) for p in processes]
        assert any(t.startswith("ray::Replica") for t in titles), titles
        assert any(t.startswith("ray::RankWorker") for t in titles), titles
        for prompt, out in zip(PROMPTS, expected):
            response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == out.outputs[0].text
    finally:
        code = server.terminate()
    assert code == 0, server.logs()
    gone, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]
