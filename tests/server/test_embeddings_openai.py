"""POST /v1/embeddings through the official `openai` client: transformers' final normed hidden
states pooled as --pooling says and L2-normalised, every input form, base64, usage, OpenAI-style
400s naming the field; and, in-process, no KV block used while completions decode alongside."""
from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from inproc_server import serve_in_thread, wait_until
from live_server import LiveServer
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.server.app import build_app

TEXTS = ["It is a truth universally acknowledged, that",
         "In the beginning God created",
         "The kernel schedules tasks; memory is managed in pages of 4096 bytes."]
HIDDEN_SIZE = 64


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mean_server(tiny_model, tmp_path_factory):
    live = LiveServer(tiny_model, tmp_path_factory.mktemp("mean") / "server.log",
                      "--pooling", "mean")
    try:
        yield live.wait_healthy()
    finally:
        assert live.terminate() == 0, live.logs()


def hf_embedding(hf, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' hidden_states[-1] is after the final norm (tests/engine/test_embedding.py
    checks it against last_hidden_state)."""
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1)


def vectors(response) -> list[torch.Tensor]:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    assert all(d.object == "embedding" for d in response.data)
    return [torch.tensor(d.embedding) for d in response.data]


def assert_like_transformers(got: torch.Tensor, hf, ids: list[int], pooling: str) -> None:
    assert got.shape == (HIDDEN_SIZE,) and got.norm().item() == pytest.approx(1.0, abs=1e-6)
    assert F.cosine_similarity(got, hf_embedding(hf, ids, pooling), dim=0) > 0.999


def test_a_string_is_its_last_tokens_normed_hidden_state(client, hf, reference):
    response = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float",
                                        user="someone")
    ids = reference.tokenizer.encode(TEXTS[1])
    assert response.object == "list" and response.model == "tiny"
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (len(ids), len(ids))
    [got] = vectors(response)
    assert_like_transformers(got, hf, ids, "last")


def test_strings_and_token_ids_in_order_with_usage(client, hf, reference):
    ids = [reference.tokenizer.encode(t) for t in TEXTS]
    by_text = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    one = client.embeddings.create(model="tiny", input=ids[2], encoding_format="float")
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == sum(map(len, ids))
    assert one.usage.total_tokens == len(ids[2])
    for got, again, prompt in zip(vectors(by_text), vectors(by_ids), ids):
        assert got.tolist() == again.tolist()
        assert_like_transformers(got, hf, prompt, "last")
    assert vectors(one)[0].tolist() == vectors(by_ids)[2].tolist()


def test_batched_equals_alone(client):
    batched = vectors(client.embeddings.create(model="tiny", input=TEXTS,
                                               encoding_format="float"))
    for text, got in zip(TEXTS, batched):
        [alone] = vectors(client.embeddings.create(model="tiny", input=text,
                                                   encoding_format="float"))
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-6)


def test_base64_is_the_float32_bytes_of_the_floats(client):
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    raw = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="base64")
    default = client.embeddings.create(model="tiny", input=TEXTS)   # the client asks base64
    for f, b, d in zip(floats.data, raw.data, default.data):
        assert isinstance(b.embedding, str)
        data = base64.b64decode(b.embedding)
        assert list(struct.unpack(f"<{HIDDEN_SIZE}f", data)) == f.embedding
        assert list(d.embedding) == f.embedding


def test_dimensions_only_the_models_own(client):
    ok = client.embeddings.create(model="tiny", input="hello", dimensions=HIDDEN_SIZE)
    assert len(ok.data[0].embedding) == HIDDEN_SIZE
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="hello", dimensions=32)
    assert e.value.status_code == 400 and e.value.param == "dimensions"
    assert "dimensions" in e.value.message and "64" in e.value.message


@pytest.mark.parametrize("given, message", [
    ([1] * 513, "input has 513 tokens, but max_model_len is 512"),
    ([[1, 2], [1] * 513], "input has 513 tokens, but max_model_len is 512"),
    ("", "input: must not be empty, nor hold an empty input"),
    ([], "input: must not be empty, nor hold an empty input"),
    (["fine", ""], "input: must not be empty, nor hold an empty input"),
    ([[1, 2], []], "input: must not be empty, nor hold an empty input"),
    ([7, 320], "token id 320 is outside the vocabulary (0..319)"),
    (["a"] * 2049, "input: holds 2049 inputs, more than 2048"),     # OpenAI's limit
])
def test_bad_input_is_a_400_naming_input(client, given, message):
    assert client.models.retrieve("tiny").model_extra["max_model_len"] == 512
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input=given)
    assert e.value.param == "input" and message in e.value.message


def test_another_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="other", input="hello")
    assert e.value.param == "model"


def test_mean_pooling(mean_server, hf, reference):
    with openai.OpenAI(base_url=f"{mean_server.url}/v1", api_key="none", max_retries=0) as c:
        response = c.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    for got, text in zip(vectors(response), TEXTS):
        assert_like_transformers(got, hf, reference.tokenizer.encode(text), "mean")
        torch.testing.assert_close(got, torch.tensor(reference.embed(text, "mean")[0]),
                                   rtol=0, atol=1e-6)           # what LLM.embed returns


LONG = {"model": "tiny", "prompt": TEXTS[0], "max_tokens": 200, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture
def inproc(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(kv_cache_memory="4MiB", dtype="float32",
                                                device="cpu"))
    with serve_in_thread(build_app(engine, "tiny")) as url:
        yield engine, url


def test_embeddings_between_decode_steps_use_no_kv_block(inproc, reference):
    engine, url = inproc
    params = SamplingParams(max_tokens=LONG["max_tokens"], temperature=0, ignore_eos=True)
    expected = reference.generate(TEXTS[0], params, use_tqdm=False)[0].outputs[0].text
    free = engine.block_manager.num_free_blocks
    with httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        completion = pool.submit(http.post, "/v1/completions", json=LONG)
        wait_until(lambda: engine.block_manager.num_free_blocks < free,
                   what="the completion holding blocks")
        embedded = http.post("/v1/embeddings", json={"input": TEXTS * 4})
        assert embedded.status_code == 200 and len(embedded.json()["data"]) == 12
        assert completion.result(60).json()["choices"][0]["text"] == expected
    assert engine.block_manager.num_free_blocks == free


def test_a_failing_embedding_is_a_500_and_the_engine_serves_on(inproc, monkeypatch):
    engine, url = inproc
    monkeypatch.setattr(engine, "embed", lambda *a: 1 / 0)
    with httpx.Client(base_url=url, timeout=60) as http:
        failed = http.post("/v1/embeddings", json={"input": "hello"})
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "request_failed"
        assert "ZeroDivisionError" in failed.json()["error"]["message"]
        monkeypatch.undo()
        assert http.post("/v1/embeddings", json={"input": "hello"}).status_code == 200
        assert http.get("/health").status_code == 200
