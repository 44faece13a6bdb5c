"""Gemma 3 270M, the second embedded model: imported from its Q4_K_M GGUF, run by the paged
engine, token for token what transformers generates from the same GGUF."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gguf_files import gguf_parsed_once
from kvslim.cli.main import main
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.models.config import ModelConfig
from kvslim.tokenizer.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,"]
NEW = 12


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    """transformers' own GGUF loader and tokenizer on the same file: ids and greedy tokens."""
    kw = dict(gguf_file=gemma3_gguf.name)
    with gguf_parsed_once():
        hf = AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, dtype=torch.float32,
                                                  **kw).eval()
        tok = AutoTokenizer.from_pretrained(gemma3_gguf.parent, **kw)
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW)
            out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return out


def test_config_is_gemma3_270m(gemma3_dir):
    c = ModelConfig.from_dir(gemma3_dir)
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.head_dim) == \
        ("Gemma3ForCausalLM", 18, 640, 256)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (4, 1, 262144)
    assert c.layer_sliding_windows.count(None) == 3 and c.sliding_window == 512
    assert c.layer_sliding_windows[5] is None and c.layer_sliding_windows[4] == 512
    assert Tokenizer.from_dir(gemma3_dir).prepended_bos_id == 2     # <bos>, before every text


def test_engine_matches_transformers_on_the_same_gguf(gemma3_dir, reference):
    engine = LLMEngine(gemma3_dir, EngineConfig(dtype="float32", device="cpu",
                                                kv_cache_memory="64MiB"))
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    for rid, (prompt_ids, tokens) in zip(ids, reference):
        assert done[rid].prompt_token_ids == prompt_ids
        assert done[rid].outputs[0].token_ids == tokens
    assert engine.kv_cache_stats().num_used_blocks == 0


def test_named_model_on_the_cli(gemma3_dir, capsys):
    assert main(["info", "gemma3-270m", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "Gemma3ForCausalLM"
    assert info["kv_bytes_per_token"] == 2 * 18 * 1 * 256 * 4
