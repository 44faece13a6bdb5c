"""Faults inside the engine: a request whose own processing fails gets an OpenAI-style error
(500, or an error event when streaming) while the others are served; when the engine itself
cannot go on, every open request gets its error at once, /health turns 503 and `kvslim serve`
exits non-zero so that a supervisor restarts it."""
from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from inproc_server import health, serve_in_thread, wait_until
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.server.app import build_app

LONG = {"prompt": "It is a truth", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture
def engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(kv_cache_memory="4MiB", dtype="float32",
                                              device="cpu"))


def sse_events(response: httpx.Response) -> list:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def stream_and_post(url: str, engine: LLMEngine, break_engine) -> tuple[list, httpx.Response]:
    """A streaming and a non-streaming request, both generating when `break_engine()` runs;
    the stream's events and the other's response (bounded waits: a hang fails the test)."""
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http, ThreadPoolExecutor(1) as pool:
        with http.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            first = next(lines)
            plain = pool.submit(http.post, "/v1/completions", json=LONG)
            wait_until(lambda: len(engine.requests) >= 2, what="both requests running")
            break_engine()
            rest = [line[len("data: "):] for line in lines]
        return [first, *rest], plain.result(timeout=30)


def test_engine_crash_answers_every_open_request_even_if_aborts_fail(engine):
    """Regression: `_shut` aborted the requests on the broken engine before answering the
    clients, so an abort that raised left every stream and every non-streaming request hanging."""
    app = build_app(engine, "tiny")
    with serve_in_thread(app) as url:
        real_step = engine.step
        broken = threading.Event()

        def step():
            if broken.is_set():
                raise RuntimeError("simulated engine failure")
            return real_step()

        def abort_request(request_id):
            raise RuntimeError("simulated abort failure")

        engine.step = step
        engine.abort_request = abort_request
        events, plain = stream_and_post(url, engine, broken.set)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "engine_dead"
        assert health(url) == 503


def test_a_failing_request_gets_its_error_and_the_others_are_served(engine, reference):
    app = build_app(engine, "tiny")
    real_output = engine._output
    poisoned = {"prompt": "The kernel schedules tasks", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}

    def output(state):
        if state.prompt == poisoned["prompt"] and state.seqs[0].num_output_tokens >= 3:
            raise ValueError("simulated fault in one request")
        return real_output(state)

    engine._output = output
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http, \
            ThreadPoolExecutor(2) as pool:
        good = pool.submit(http.post, "/v1/completions", json=dict(LONG, max_tokens=12))
        bad = http.post("/v1/completions", json=poisoned)
        assert bad.status_code == 500
        error = bad.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "request_failed"
        assert "simulated fault" in error["message"]
        with http.stream("POST", "/v1/completions", json=dict(poisoned, stream=True)) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_failed"
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert chat.status_code == 200
        greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        expected = reference.generate([LONG["prompt"]], greedy)[0]
        assert good.result(timeout=30).json()["choices"][0]["text"] == expected.outputs[0].text
        assert health(url) == 200
        wait_until(lambda: engine.kv_cache_stats().num_used_blocks == 0, what="blocks freed")


def test_serve_exits_1_when_the_engine_dies(tiny_model, monkeypatch):
    """`kvslim serve` (run_serve in this process, so that the fault can be injected) stops by
    itself once the engine thread has died, with exit code 1. A watchdog SIGTERM bounds the
    test; it would make run_serve return 0."""
    from kvslim.cli import serve_cmds
    from kvslim.cli.main import build_parser
    from live_server import ENGINE_FLAGS, free_port

    port = free_port()
    args = build_parser().parse_args(["serve", str(tiny_model), "--port", str(port),
                                      "--log-level", "warning", *ENGINE_FLAGS])
    real_llm_from_args = serve_cmds.llm_from_args

    def llm_from_args(a):
        llm = real_llm_from_args(a)

        def step():
            raise RuntimeError("simulated engine failure")

        llm.engine.step = step
        return llm

    monkeypatch.setattr(serve_cmds, "llm_from_args", llm_from_args)
    answers, watchdog_fired = [], []

    def client():
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: _up(url), timeout=60, what="server up")
            answers.append(httpx.post(f"{url}/v1/completions", json=LONG, timeout=30).status_code)
        finally:
            if not stopped.wait(30):
                watchdog_fired.append(True)
                os.kill(os.getpid(), signal.SIGTERM)

    stopped = threading.Event()
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        code = serve_cmds.run_serve(args)
    finally:
        stopped.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    thread.join(10)
    assert answers == [503]
    assert not watchdog_fired, "the server did not stop by itself"
    assert code == 1


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "seed": 2**64}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "seed": -2**63 - 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                              "seed": 2**70}),
])
def test_a_seed_beyond_64_bits_is_refused_not_fatal(engine, route, body):
    """Found by probing the fuzzer's blind spots: torch cannot take such a seed, and it used
    to fail the whole batch's sampling step, killing the engine."""
    from starlette.testclient import TestClient
    with TestClient(build_app(engine, "tiny")) as http:
        response = http.post(route, json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "seed"
        ok = http.post(route, json=dict(body, seed=2**64 - 1))
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200
