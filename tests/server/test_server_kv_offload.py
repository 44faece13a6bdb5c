"""The server with a KV offload tier: a restarted server (a new engine on the same directory)
serves a long prompt's prefix from disk, reports it in usage.prompt_tokens_details
.cached_tokens, and counts the tier's hits and bytes in /metrics."""
from __future__ import annotations

import re

import httpx
import openai

from inproc_server import serve_in_thread
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.server.app import build_app

PROMPT = list(range(3, 83))                       # 80 tokens: 19 full blocks of 4 before the last


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def _complete(engine, path):
    with serve_in_thread(build_app(engine, "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        return out, httpx.get(f"{url}/metrics", timeout=30).text


def test_a_restarted_server_serves_the_prefix_from_disk(tiny_model, tmp_path):
    config = dict(kv_cache_memory="4MiB", dtype="float32", device="cpu", block_size=4,
                  kv_offload_dir=str(tmp_path))
    first, _ = _complete(LLMEngine(tiny_model, EngineConfig(**config,
                                                            kv_offload_write_through=True)), tmp_path)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again, metrics = _complete(LLMEngine(tiny_model, EngineConfig(**config)), tmp_path)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 76
    assert _metric(metrics, "kvslim_kv_offload_hits_total") == 19
    assert _metric(metrics, "kvslim_kv_offload_bytes_read_total") > 0
    assert _metric(metrics, "kvslim_kv_offload_rejected_total") == 0
