"""`schemathesis run .../openapi.json --checks all` (short: a few cases per operation, fixed
seed) against a live `kvslim serve` finds no failure. The two rules JSON Schema cannot express
(the rendered prompt plus max_tokens within max_model_len, min_tokens at most max_tokens) are
in the schema's descriptions and told to schemathesis by schemathesis_hooks.py, which drops
generated "valid" cases that break them (the server's 400s for them: test_server_errors.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

HOOKS = Path(__file__).with_name("schemathesis_hooks.py")


@pytest.fixture(scope="module")
def small_server(tiny_model, tmp_path_factory):
    live = LiveServer(tiny_model, tmp_path_factory.mktemp("st") / "server.log",
                      "--max-model-len", "256", "--max-num-seqs", "16")
    try:
        yield live.wait_healthy()
    finally:
        assert live.terminate() == 0, live.logs()


def test_schemathesis_all_checks_finds_no_failure(small_server, tmp_path):
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    env = dict(os.environ, SCHEMATHESIS_HOOKS=str(HOOKS), KVSLIM_SERVER_URL=small_server.url)
    done = subprocess.run([exe, "run", f"{small_server.url}/openapi.json", "--checks", "all",
                           "--max-examples", "20", "--seed", "1", "--output-sanitize", "false",
                           "--no-color"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)
    out = done.stdout
    assert "API Operations" in out and "Tested: 12" in out, out[-3000:]
    failures = out[out.find("FAILURES"):]
    assert done.returncode == 0 and "Failures:" not in out, failures[:3000]


def test_the_relations_are_in_the_schema(small_server):
    schema = httpx.get(f"{small_server.url}/openapi.json").json()
    text = json.dumps(schema)
    assert "plus max_tokens must not exceed max_model_len (256)" in text
    assert "Must not exceed max_tokens" in text


def test_decimal_below_matches_exactly_the_ids_below_the_vocabulary():
    from kvslim.server.openapi import decimal_below
    for n in [1, 2, 10, 11, 100, 320, 1001]:
        pattern = re.compile(decimal_below(n))
        assert [i for i in range(3 * n + 20) if pattern.fullmatch(str(i))] == list(range(n))
        assert bool(pattern.fullmatch("007")) == (7 < n) and not pattern.fullmatch("")
