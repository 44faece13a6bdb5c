"""`kvslim bench serve` against a real `kvslim serve`: the report, --json, failures; and the
statistics on hand-made results."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from checkpoints import write_checkpoint

from kvslim_lab.bench.serve import RequestResult, ServeBenchConfig, summarize
from kvslim.cli.main import main

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from live_server import LiveServer  # noqa: E402

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 16, 6


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_serve")
    live = LiveServer(write_checkpoint("gqa", root / "gqa"), root / "server.log")
    try:
        yield live.wait_healthy()
    finally:
        assert live.terminate() == 0, live.logs()


def bench(server, capsys, *extra: str) -> tuple[int, str]:
    code = main(["bench", "serve", "--url", server.url, "--num-prompts", str(NUM_PROMPTS),
                 "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                 "--max-concurrency", "4", "--request-rate", "100", *extra])
    return code, capsys.readouterr().out


def test_json_report_counts_every_token(bench_server, capsys):
    code, out = bench(bench_server, capsys, "--json", "--no-progress")
    assert code == 0
    result = json.loads(out)
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN      # exact via /tokenize
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["config"]["model"] == "tiny" and result["config"]["max_concurrency"] == 4
    for name in ("ttft", "tpot", "itl", "e2el"):
        mean, median, p99 = (result[f"{s}_{name}_ms"] for s in ("mean", "median", "p99"))
        assert 0 < median <= p99 and mean > 0
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]


def test_text_report(bench_server, capsys):
    code, out = bench(bench_server, capsys)
    assert code == 0
    for label in ("Serving Benchmark Result", "Successful requests:", "Failed requests:",
                  "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):"):
        assert label in out
    assert f"Successful requests:{' ' * 20}{NUM_PROMPTS}" in out


def test_failures_are_counted(bench_server, capsys):
    code, out = bench(bench_server, capsys, "--model", "no-such-model", "--json",
                      "--no-progress")
    assert code == 1
    result = json.loads(out)
    assert result["completed"] == 0 and result["failed"] == NUM_PROMPTS
    assert "404" in result["errors"][0]


def test_summarize_statistics():
    config = ServeBenchConfig(url="http://x/v1", num_prompts=3, model="m")
    results = [RequestResult(True, 10, 5, ttft=0.1, itl=[0.01] * 4, latency=0.5),
               RequestResult(True, 10, 3, ttft=0.3, itl=[0.02, 0.04], latency=0.7),
               RequestResult(False, error="HTTP 500: boom")]
    r = summarize(config, results, duration=2.0)
    assert (r.completed, r.failed, r.errors) == (2, 1, ["HTTP 500: boom"])
    assert (r.total_input_tokens, r.total_output_tokens) == (20, 8)
    assert r.request_throughput == 1.0 and r.output_throughput == 4.0
    assert r.latency_ms["mean_ttft_ms"] == pytest.approx(200)
    assert r.latency_ms["median_e2el_ms"] == pytest.approx(600)
    assert r.latency_ms["mean_tpot_ms"] == pytest.approx((100 + 200) / 2)   # (0.4/4, 0.4/2)
    assert r.latency_ms["mean_itl_ms"] == pytest.approx(1000 * 0.1 / 6)
    assert r.config["url"] == "http://x" and "api_key" not in r.config
    assert r.config["request_rate"] == "inf"
