"""`schemathesis run .../openapi.json --checks all` (short: a few cases per operation, fixed
seed) against a live `kvslim serve`: no failure but the refusals JSON Schema cannot express
(a request whose rendered prompt and max_tokens together exceed max_model_len, or min_tokens
above max_tokens) — those are 400s by design, each named in docs/structured_outputs.md."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import LiveServer

RELATIONAL = [r"prompt has \d+ tokens, but max_model_len is \d+",
              r"prompt \(\d+ tokens\) \+ max_tokens \(\d+\) = \d+ exceeds max_model_len",
              r"min_tokens \(\d+\) must not exceed max_tokens \(\d+\)"]


@pytest.fixture(scope="module")
def small_server(tiny_model, tmp_path_factory):
    live = LiveServer(tiny_model, tmp_path_factory.mktemp("st") / "server.log",
                      "--max-model-len", "256", "--max-num-seqs", "16")
    try:
        yield live.wait_healthy()
    finally:
        assert live.terminate() == 0, live.logs()


def test_schemathesis_all_checks_finds_only_relational_refusals(small_server, tmp_path):
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    done = subprocess.run([exe, "run", f"{small_server.url}/openapi.json", "--checks", "all",
                           "--max-examples", "20", "--seed", "1", "--output-sanitize", "false",
                           "--no-color"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    out = done.stdout
    assert "API Operations" in out and "Tested: 8" in out, out[-3000:]
    codes = set(re.findall(r"^- (ST\d+) ", out, re.M))
    assert codes <= {"ST202"}, out[-6000:]
    messages = re.findall(r'\[400\] Bad Request:\s+`\{"error":\{"message":"([^"]+)"', out)
    unexplained = [m for m in messages if not any(re.search(p, m) for p in RELATIONAL)]
    assert not unexplained, unexplained
