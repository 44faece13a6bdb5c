"""The server over an int8 KV cache: `kvslim serve --kv-cache-dtype int8` parses and passes its
checks, and the OpenAI routes answer with the offline engine's greedy text."""
from __future__ import annotations

import httpx

from inproc_server import serve_in_thread
from kvslim.cli.engine_args import check_args, engine_config_from_args
from kvslim.cli.main import build_parser
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.server.app import build_app

BODY = {"prompt": "It is a truth", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_serve_flag_reaches_the_engine_config(tiny_model):
    args = build_parser().parse_args(["serve", str(tiny_model), "--kv-cache-dtype", "int8",
                                      "--device", "cpu"])
    check_args(args)
    assert engine_config_from_args(args).kv_cache_dtype == "int8"


def test_completion_over_an_int8_cache(tiny_model):
    config = EngineConfig(kv_cache_memory="4MiB", dtype="float32", device="cpu",
                          kv_cache_dtype="int8")
    offline = LLMEngine(tiny_model, config)
    offline.add_request(BODY["prompt"], SamplingParams(max_tokens=12, temperature=0,
                                                       ignore_eos=True))
    while offline.has_unfinished_requests():
        outs = offline.step()
    expected = outs[0].outputs[0].text
    engine = LLMEngine(tiny_model, config)
    with serve_in_thread(build_app(engine, "tiny")) as url:
        response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected
    assert engine.kv_cache_stats().kv_cache_dtype == "int8"
    assert engine.kv_cache_stats().num_used_blocks == 0
