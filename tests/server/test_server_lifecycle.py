"""Lifecycle: SIGTERM stops accepting, lets in-flight streams finish, exits 0 (on the shared
server, so that test runs last); /health is 200 only while the engine loop is alive."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from starlette.testclient import TestClient

from live_server import LiveServer
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.server.app import build_app


@pytest.mark.stops_server
def test_sigterm_drains_in_flight_stream_then_exits_0(server):
    body = {"prompt": "It is a truth", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            next(lines)                                       # generation has started
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):          # no longer accepting
                httpx.get(f"{server.url}/health", timeout=5)
            rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    usage = json.loads(rest[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 400                  # finished, not cut
    assert server.terminate() == 0, server.logs()


def test_repeated_sigterm_still_exits_0(tiny_model, tmp_path):
    """A second SIGTERM (an impatient supervisor) while the server shuts down after its drain
    must not turn the clean exit into a kill."""
    live = LiveServer(tiny_model, tmp_path / "server.log").wait_healthy()
    live.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while live.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
        try:
            live.process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            break
    assert live.terminate() == 0, live.logs()


def test_health_follows_the_engine_loop(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(kv_cache_memory="4MiB", dtype="float32",
                                                device="cpu"))
    app = build_app(engine, "tiny")
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert ok.status_code == 200

        def broken_step():
            raise RuntimeError("simulated engine failure")

        engine.step = broken_step
        failed = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert failed.status_code == 503
        assert failed.json()["error"]["code"] == "engine_dead"
        assert http.get("/health").status_code == 503
        again = http.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]})
        assert again.status_code == 503
        assert "kvslim_engine_alive 0.0" in http.get("/metrics").text
