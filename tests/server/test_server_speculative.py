"""The server with speculative decoding: `--speculative-config` reaches the engine, completions
equal the offline engine's greedy text, and /metrics counts draft and accepted tokens."""
from __future__ import annotations

import re

import httpx
import pytest

from inproc_server import serve_in_thread
from kvslim.cli.engine_args import check_args, engine_config_from_args
from kvslim.cli.main import build_parser
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.server.app import build_app

PROMPT = "a b c a b c a b c a b"
BODY = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def test_serve_flag_reaches_the_engine_config(tiny_model):
    args = build_parser().parse_args(["serve", str(tiny_model), "--device", "cpu",
                                      "--speculative-config", '{"method": "ngram"}'])
    check_args(args)
    assert engine_config_from_args(args).speculative.method == "ngram"


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_completions_and_metrics_with_speculation(tiny_model):
    config = dict(kv_cache_memory="4MiB", dtype="float32", device="cpu")
    plain = LLMEngine(tiny_model, EngineConfig(**config))
    engine = LLMEngine(tiny_model, EngineConfig(**config, speculative=SPEC))
    texts = []
    for eng in (plain, engine):
        with serve_in_thread(build_app(eng, "tiny")) as url:
            response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert texts[1] == texts[0]
    stats = engine.spec_decode_stats()
    assert stats.num_draft_tokens > 0
    assert _metric(metrics, "kvslim_spec_decode_draft_tokens_total") == stats.num_draft_tokens
    assert _metric(metrics, "kvslim_spec_decode_accepted_tokens_total") == \
        stats.num_accepted_tokens
    assert _metric(metrics, "kvslim_spec_decode_acceptance_rate") == \
        pytest.approx(stats.acceptance_rate, abs=1e-9)
    for i, (drafted, accepted) in enumerate(zip(stats.drafted_per_position,
                                                stats.accepted_per_position)):
        label = '{position="%d"}' % i
        assert _metric(metrics, "kvslim_spec_decode_draft_tokens_per_position_total"
                       + re.escape(label)) == drafted
        assert _metric(metrics, "kvslim_spec_decode_accepted_tokens_per_position_total"
                       + re.escape(label)) == accepted
    assert engine.kv_cache_stats().num_used_blocks == 0

