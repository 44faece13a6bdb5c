"""One `kvslim serve` process for the server tests (session-wide: starting one costs seconds),
with an API key, on a tiny random GQA checkpoint; plus the offline `LLM` on the same checkpoint
as the reference for greedy outputs."""
from __future__ import annotations

import pytest
from checkpoints import write_checkpoint
from live_server import API_KEY, LiveServer


def pytest_configure(config):
    config.addinivalue_line("markers", "stops_server: stops the shared server; runs last")


def pytest_collection_modifyitems(config, items):
    # Shutting the shared server down is itself a test (SIGTERM drains in-flight work), so it
    # goes after every test that needs the server; the stable sort keeps the others' order.
    # Under pytest-xdist this folder runs on one worker, in this order (tests/conftest.py).
    items.sort(key=lambda item: item.get_closest_marker("stops_server") is not None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_checkpoint("gqa", tmp_path_factory.mktemp("serve") / "gqa")


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    live = LiveServer(tiny_model, tmp_path_factory.mktemp("logs") / "server.log",
                      api_key=API_KEY)
    try:
        live.wait_healthy()
        yield live
    finally:                                  # already stopped if the stops_server test ran
        code = live.terminate()
        assert code == 0, f"server exited with {code} after SIGTERM:\n{live.logs()}"


@pytest.fixture(scope="session")
def reference(tiny_model):
    from kvslim.engine.llm import LLM
    return LLM(str(tiny_model), dtype="float32", device="cpu", kv_cache_memory="4MiB")


@pytest.fixture
def client(server):
    import openai
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture
def async_client(server):
    """A factory: an AsyncOpenAI client belongs to one event loop, so each asyncio.run makes
    its own."""
    import openai
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def smol_server(smollm2_dir, tmp_path_factory):
    """`kvslim serve` on SmolLM2 (float32), no API key: structured outputs and tool calls need
    a model that means what it writes."""
    live = LiveServer(smollm2_dir, tmp_path_factory.mktemp("smol") / "server.log",
                      "--kv-cache-memory", "512MiB", "--threads", "2")
    try:
        yield live.wait_healthy(timeout=300)
    finally:
        assert live.terminate() == 0, live.logs()
