"""An app served by uvicorn on 127.0.0.1 in a daemon thread of the test process, so that a test
can reach into the engine (inject faults, read KV-cache stats) while real HTTP clients talk to
it. A server that never stops cannot hang the test run: the thread is a daemon."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from live_server import free_port


@contextmanager
def serve_in_thread(app, timeout: float = 30.0):
    """Yields the base URL once the server accepts connections; stops it on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


def wait_until(predicate, timeout: float = 20.0, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value (returned), or AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached after {timeout} s")


def health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).status_code
