"""`kvslim serve --data-parallel-size 2` on a local Ray runtime, end to end: two replicas of a
tiny random model behind one API server. Greedy answers equal one engine's; prefix routing keeps
a shared prefix on one replica (a higher prefix-cache hit rate than round robin); a replica
killed under load costs only its own requests, Ray restarts it and /health says degraded until
it is back; the engine series carry engine="N"; a stopped server leaves no Ray process."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the replicas run on Ray: pip install 'kvslim[ray]'")
psutil = pytest.importorskip("psutil")

from checkpoints import write_checkpoint  # noqa: E402
from live_server import LiveServer  # noqa: E402

from kvslim.engine.sampling_params import SamplingParams  # noqa: E402

DP_FLAGS = ("--data-parallel-size", "2", "--kv-cache-memory", "2MiB")
PROMPTS = ["It is a truth universally acknowledged, that", "In the beginning God created",
           "The kernel schedules tasks; memory is", "must be in want of a wife. In the"]
BLOCK = 16                                   # live_server's --block-size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint("gqa", tmp_path_factory.mktemp("dp") / "gqa")


def start(tiny, tmp_path_factory, routing: str) -> LiveServer:
    log = tmp_path_factory.mktemp("dp-logs") / f"serve-{routing}.log"
    return LiveServer(tiny, log, *DP_FLAGS, "--routing", routing).wait_healthy(timeout=240)


@pytest.fixture(scope="module")
def prefix_server(tiny, tmp_path_factory):
    live = start(tiny, tmp_path_factory, "prefix")
    yield live
    live.terminate()                         # already stopped by the shutdown test


@pytest.fixture(scope="module")
def rr_server(tiny, tmp_path_factory):
    live = start(tiny, tmp_path_factory, "round-robin")
    yield live
    live.terminate()


def complete(server: LiveServer, prompt, max_tokens: int = 12, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_answers_equal_one_engine(prefix_server, tiny):
    from kvslim.engine.llm import LLM
    with LLM(str(tiny), dtype="float32", device="cpu", kv_cache_memory="2MiB") as llm:
        expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12),
                                use_tqdm=False)
    answers = [None] * len(PROMPTS)

    def ask(i: int) -> None:
        answers[i] = complete(prefix_server, PROMPTS[i])["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [out.outputs[0].text for out in expected]
    batch = complete(prefix_server, PROMPTS)              # several prompts, one replica
    assert [c["text"] for c in batch["choices"]] == [o.outputs[0].text for o in expected]


def test_bad_request_is_an_openai_400(prefix_server):
    response = httpx.post(f"{prefix_server.url}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "hello", "max_tokens": 100_000})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{prefix_server.url}/health").json()["status"] == "ok"


def shared_prefix_hit_rate(server: LiveServer) -> tuple[float, list[int]]:
    """4 groups of 4 prompts, each group sharing 3 blocks, sent one after another: the
    fraction of prompt tokens the replicas' prefix caches served, and each request's count."""
    cached, total = [], 0
    for group in range(4):
        prefix = [20 + (group * 37 + i) % 280 for i in range(3 * BLOCK)]
        for member in range(4):
            usage = complete(server, prefix + [11 + member] * 8, max_tokens=1)["usage"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            total += usage["prompt_tokens"]
    return sum(cached) / total, cached


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica(prefix_server, rr_server):
    prefix_rate, prefix_cached = shared_prefix_hit_rate(prefix_server)
    rr_rate, rr_cached = shared_prefix_hit_rate(rr_server)
    # Prefix routing: only each group's first request misses (one replica holds the group).
    assert prefix_cached == [0, 3 * BLOCK, 3 * BLOCK, 3 * BLOCK] * 4
    # Round robin: each group's first request on each replica misses.
    assert rr_cached.count(0) == 8
    assert prefix_rate > rr_rate


def test_metrics_label_each_engine(prefix_server):
    metrics = prefix_server.metrics()
    for engine in ("0", "1"):
        for series in ("kvslim_generation_tokens_total", "kvslim_num_requests_running",
                       "kvslim_num_requests_waiting", "kvslim_kv_cache_usage_ratio"):
            assert f'{series}{{engine="{engine}"}}' in metrics, series
        assert metrics[f'kvslim_replica_up{{engine="{engine}"}}'] == 1
    finished = sum(v for k, v in metrics.items()
                   if k.startswith("kvslim_completions_finished_total{"))
    assert finished >= len(PROMPTS)
    assert "kvslim_generation_tokens_total" not in metrics      # only per engine
    # The API server's own counters, unlabelled by engine as before.
    assert metrics['kvslim_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert metrics["kvslim_replicas_ready"] == 2


def stream_long(server: LiveServer, prompt: str, started: threading.Event, out: dict) -> None:
    """A streamed completion of 400 tokens: out["tokens"] (the usage's), out["error"] if
    any; `started` is set at the first chunk."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out.update(tokens=0, error=None)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                out["error"] = chunk["error"]
            elif chunk["usage"]:
                out["tokens"] = chunk["usage"]["completion_tokens"]
            started.set()


def test_a_killed_replica_costs_only_its_own_requests(rr_server):
    health = httpx.get(f"{rr_server.url}/health").json()
    victim = health["engines"][1]["pid"]
    outs = [{} for _ in range(6)]
    events = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=stream_long, args=(rr_server, f"request {i} of six",
                                                          e, o))
               for i, (e, o) in enumerate(zip(events, outs))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in events)            # every request is streaming
    os.kill(victim, signal.SIGKILL)
    seen = watch_health(rr_server)
    for t in threads:
        t.join(120)
    completed = [o for o in outs if o["error"] is None]
    failed = [o for o in outs if o["error"] is not None]
    # Round robin put three on each replica: the survivor's all finished.
    assert len(completed) == 3 and all(o["tokens"] == 400 for o in completed)
    assert len(failed) == 3 and all("replica" in o["error"]["message"] for o in failed)
    statuses = seen()
    assert "degraded" in statuses and statuses[-1] == "ok"
    after = httpx.get(f"{rr_server.url}/health").json()
    assert after["restarts"] == 1 and after["engines"][1]["pid"] != victim
    complete(rr_server, PROMPTS[0])                   # both replicas serve again
    complete(rr_server, PROMPTS[1])
    assert rr_server.metrics()['kvslim_replica_restarts_total{engine="1"}'] == 1


def watch_health(server: LiveServer, timeout: float = 120.0):
    """Polls /health in a thread until it is "ok" again after a restart; the returned function
    waits for that and gives the statuses seen, in order."""
    statuses: list[str] = []

    def poll() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = httpx.get(f"{server.url}/health", timeout=10).json()
            if not statuses or statuses[-1] != body["status"]:
                statuses.append(body["status"])
            if body["status"] == "ok" and body["restarts"] >= 1:
                return
            time.sleep(0.05)

    thread = threading.Thread(target=poll)
    thread.start()

    def seen() -> list[str]:
        thread.join(timeout)
        return statuses

    return seen


def test_shutdown_leaves_no_ray_process(prefix_server, rr_server):
    for server in (prefix_server, rr_server):
        children = psutil.Process(server.process.pid).children(recursive=True)
        names = " ".join(p.name() for p in children)
        assert "raylet" in names and "gcs_server" in names
        assert server.terminate() == 0, server.logs()
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
