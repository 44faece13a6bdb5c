"""A real `kvslim serve` process for the end-to-end tests: started on 127.0.0.1 with a free
port and one torch thread, ready once /health answers 200, stopped with SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-0123456789"
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--threads", "1",
                "--kv-cache-memory", "4MiB", "--block-size", "16", "--max-num-seqs", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model_dir: Path, log_path: Path, *extra: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        args = [sys.executable, "-m", "kvslim.cli.main", "serve", str(model_dir),
                "--port", str(self.port), "--served-model-name", "tiny", "--log-level",
                "warning", *ENGINE_FLAGS, *extra]
        if api_key:
            args += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self, timeout: float = 120.0) -> "LiveServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.process.kill()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.logs()}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code (killed after `timeout`: then the test fails)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.log.close()
        return code

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {name{labels}: value}; label-less names as is."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_metric(self, name: str, predicate, timeout: float = 20.0) -> float:
        """Poll /metrics until `predicate(value)`; the value, or AssertionError."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.metrics().get(name)
            if value is not None and predicate(value):
                return value
            time.sleep(0.05)
        raise AssertionError(f"{name} = {value} after {timeout} s")
