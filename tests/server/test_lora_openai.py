"""LoRA adapters served as models (`kvslim serve --enable-lora --lora-modules NAME=PATH`),
through the official `openai` client against an in-process server on the random GQA
checkpoint: /v1/models lists each adapter with the base model as parent; a request's `model`
picks the adapter, and greedy tokens equal transformers + peft with the adapter merged
(completions, chat, streamed, the base and two adapters at once; compared token by token
through logprobs, each token's text decoded alone); /v1/responses too; unknown
models are 404s, embeddings refuse adapters; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter exist with --allow-runtime-lora-updating only, and refuse what they
must; a bad --lora-modules fails the start in one line."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from inproc_server import serve_in_thread
from kvslim.cli.main import build_parser, main
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.errors import KvslimError
from kvslim.server.adapters import parse_module
from kvslim.server.app import build_app
from kvslim.server.logprobs import token_text
from kvslim.server.context import ServerOptions
from lora.peft_adapters import merged_greedy, write_adapter

PROMPT = [5, 17, 42, 9, 120, 33, 250, 7, 61]            # token ids, below the vocabulary
MAX_TOKENS = 8
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
TOKENS = dict(GREEDY, logprobs=0)                       # completions: each token's text
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def lora_engine(path) -> LLMEngine:
    return LLMEngine(path, EngineConfig(kv_cache_memory="8MiB", dtype="float32", device="cpu",
                                        enable_lora=True, max_loras=2, max_lora_rank=8))


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """name -> peft directory: rank 8 on every linear; rank 4 on q/v with rsLoRA; a third,
    loaded at runtime; one of a rank above --max-lora-rank."""
    root = tmp_path_factory.mktemp("lora-server")
    return {"wide": write_adapter(tiny_model, root / "wide", r=8, alpha=16, seed=1),
            "narrow": write_adapter(tiny_model, root / "narrow", r=4, alpha=8, seed=2,
                                    targets=["q_proj", "v_proj"], use_rslora=True),
            "third": write_adapter(tiny_model, root / "third", r=8, alpha=8, seed=3),
            "too_big": write_adapter(tiny_model, root / "too_big", r=16, alpha=16, seed=4,
                                     targets=["q_proj"])}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return lora_engine(tiny_model)


@pytest.fixture(scope="module")
def url(engine, adapters):
    options = ServerOptions(lora_modules=[f"wide={adapters['wide']}",
                                          f"narrow={adapters['narrow']}"],
                            allow_runtime_lora_updating=True)
    with serve_in_thread(build_app(engine, "tiny", options=options)) as base:
        yield base


@pytest.fixture
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def expected(tiny_model, adapters):
    """model name -> transformers' greedy tokens of PROMPT (the adapter merged by peft)."""
    return {name: merged_greedy(tiny_model, adapters.get(name), [PROMPT], MAX_TOKENS)[0]
            for name in ("tiny", "wide", "narrow", "third")}


def tokens_of(engine, ids: list[int]) -> list[str]:
    """Each token's text decoded alone, as the server's logprobs name tokens."""
    return [token_text(engine.tokenizer, i) for i in ids]


def text_of(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids)


def test_models_lists_the_adapters_with_the_base_as_parent(client, adapters):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "wide", "narrow"]
    base, wide, narrow = models
    assert base.parent is None and base.root == "tiny"
    assert wide.parent == narrow.parent == "tiny" and wide.object == "model"
    assert wide.root == str(adapters["wide"]) and narrow.root == str(adapters["narrow"])
    card = client.models.retrieve("narrow")
    assert card.id == "narrow" and card.parent == "tiny"
    assert client.models.retrieve("tiny").parent is None
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


@pytest.mark.parametrize("model", ["tiny", "wide", "narrow"])
def test_completions_equal_peft_merged_greedy(client, engine, expected, model):
    response = client.completions.create(model=model, prompt=PROMPT, **TOKENS)
    assert response.model == model
    assert response.usage.completion_tokens == MAX_TOKENS
    assert response.choices[0].logprobs.tokens == tokens_of(engine, expected[model])


def test_the_adapters_change_the_answer(engine, expected):
    """Otherwise the equalities above would not tell an adapter from the base model."""
    texts = {name: text_of(engine, expected[name]) for name in expected}
    assert len(set(texts.values())) == len(expected), texts


def test_chat_with_an_adapter_equals_peft_merged_and_streams_the_same(client, url, engine,
                                                                      tiny_model, adapters):
    ids = httpx.post(f"{url}/tokenize", json={"model": "wide", "messages": MESSAGES}).json()
    want = merged_greedy(tiny_model, adapters["wide"], [ids["tokens"]], MAX_TOKENS)[0]
    whole = client.chat.completions.create(model="wide", messages=MESSAGES, logprobs=True,
                                           **GREEDY)
    assert whole.model == "wide"
    assert [t.token for t in whole.choices[0].logprobs.content] == tokens_of(engine, want)
    chunks = list(client.chat.completions.create(model="wide", messages=MESSAGES, stream=True,
                                                 **GREEDY))
    assert {c.model for c in chunks} == {"wide"}
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_streamed_completions_with_an_adapter_equal_the_whole(client, engine, expected):
    whole = client.completions.create(model="narrow", prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(model="narrow", prompt=PROMPT, stream=True,
                                            **TOKENS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens] == \
        tokens_of(engine, expected["narrow"])


def test_the_base_and_two_adapters_at_once(url, engine, expected):
    order = ["wide", "tiny", "narrow", "narrow", "tiny", "wide"]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                      timeout=60) as c:
            return await asyncio.gather(*[c.completions.create(model=m, prompt=PROMPT, **TOKENS)
                                          for m in order])

    for model, response in zip(order, asyncio.run(all_at_once())):
        assert response.model == model
        assert response.choices[0].logprobs.tokens == tokens_of(engine, expected[model]), model
    assert engine.kv_cache_stats().num_used_blocks == 0 and not engine.lora.live


def test_responses_run_the_adapter(client):
    chat = client.chat.completions.create(model="narrow", messages=MESSAGES, max_tokens=6,
                                          temperature=0)
    response = client.responses.create(model="narrow", input=MESSAGES[0]["content"],
                                       max_output_tokens=6, temperature=0)
    assert response.model == "narrow"
    assert response.output_text == chat.choices[0].message.content


def test_unknown_models_are_404_and_embeddings_refuse_adapters(client):
    for call in (lambda: client.completions.create(model="nope", prompt=PROMPT, max_tokens=2),
                 lambda: client.chat.completions.create(model="nope", messages=MESSAGES),
                 lambda: client.responses.create(model="nope", input="hi"),
                 lambda: client.embeddings.create(model="nope", input="hi")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="wide", input="hi")
    assert e.value.body["param"] == "model" and "LoRA adapter" in e.value.body["message"]
    assert len(client.embeddings.create(model="tiny", input="hi").data[0].embedding) == 64


def post(url: str, route: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=60)


def test_load_and_unload_at_runtime(url, client, engine, adapters, expected):
    loaded = post(url, "load_lora_adapter", lora_name="third", lora_path=str(adapters["third"]))
    assert loaded.status_code == 200 and "third" in loaded.text
    card = client.models.retrieve("third")
    assert card.parent == "tiny" and card.root == str(adapters["third"])
    assert [m.id for m in client.models.list().data] == ["tiny", "wide", "narrow", "third"]
    response = client.completions.create(model="third", prompt=PROMPT, **TOKENS)
    assert response.choices[0].logprobs.tokens == tokens_of(engine, expected["third"])
    assert post(url, "unload_lora_adapter", lora_name="third").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny", "wide", "narrow"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="third", prompt=PROMPT, max_tokens=2)


@pytest.mark.parametrize("route, body, status, param, words", [
    ("load_lora_adapter", {"lora_name": "wide", "lora_path": "x"}, 400, "lora_name",
     "already been loaded"),
    ("load_lora_adapter", {"lora_name": "tiny", "lora_path": "x"}, 400, "lora_name",
     "already been loaded"),
    ("load_lora_adapter", {"lora_name": "bad", "lora_path": "/no/such/dir"}, 404, "lora_path",
     "No adapter found for '/no/such/dir': no adapter_config.json"),
    ("load_lora_adapter", {"lora_name": "bad", "lora_path": "x" * 5000}, 404, "lora_path",
     "No adapter found"),
    ("load_lora_adapter", {"lora_name": "bad", "lora_path": "too_big"}, 400, "lora_path",
     "rank 16"),
    ("load_lora_adapter", {"lora_name": "bad"}, 400, "lora_path", "lora_path"),
    ("unload_lora_adapter", {"lora_name": "nope"}, 404, "lora_name", "cannot be found"),
    ("unload_lora_adapter", {}, 400, "lora_name", "lora_name")],
    ids=["load-twice", "load-base-name", "no-dir", "name-too-long", "rank-too-big",
         "no-path", "unload-unknown", "unload-no-name"])
def test_load_and_unload_refusals(url, client, adapters, route, body, status, param, words):
    if body.get("lora_path") in adapters:
        body = dict(body, lora_path=str(adapters[body["lora_path"]]))
    answer = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert [m.id for m in client.models.list().data] == ["tiny", "wide", "narrow"]


def test_an_adapter_in_use_is_not_unloaded(url, client, engine, monkeypatch):
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])   # 2 s in all
    body = {"model": "wide", "prompt": PROMPT, "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()                      # (dropped, it would close the stream)
        next(lines)                                      # running now
        busy = post(url, "unload_lora_adapter", lora_name="wide")
        assert engine.has_unfinished_requests()
    assert busy.status_code == 400 and "unfinished" in busy.json()["error"]["message"]
    assert [m.id for m in client.models.list().data] == ["tiny", "wide", "narrow"]
    assert client.completions.create(model="wide", prompt=PROMPT, max_tokens=2).model == "wide"


@pytest.fixture(scope="module")
def spare_engine(tiny_model):
    """For apps of other options: ids 1, 2, ... would be the served app's adapters' ids."""
    return lora_engine(tiny_model)


def test_without_the_flag_the_routes_do_not_exist(spare_engine):
    with serve_in_thread(build_app(spare_engine, "tiny")) as base:
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            assert post(base, route, lora_name="x", lora_path="y").status_code == 404
        paths = httpx.get(f"{base}/openapi.json").json()["paths"]
        assert "/v1/load_lora_adapter" not in paths


def test_the_schema_describes_the_routes_with_the_flag(spare_engine):
    app = build_app(spare_engine, "tiny", options=ServerOptions(allow_runtime_lora_updating=True))
    paths = app.openapi()["paths"]
    for route, fields in (("load_lora_adapter", ["lora_name", "lora_path"]),
                          ("unload_lora_adapter", ["lora_name"])):
        operation = paths[f"/v1/{route}"]["post"]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = app.openapi()["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert schema["required"] == fields
        assert "text/plain" in operation["responses"]["200"]["content"]
        assert {"400", "404"} <= set(operation["responses"]) and "422" not in \
            operation["responses"]


def test_schemathesis_all_checks_on_the_lora_routes(spare_engine, tmp_path):
    """What the schema says of them holds (test_openapi_conformance.py: the other routes)."""
    exe = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    app = build_app(spare_engine, "tiny", options=ServerOptions(allow_runtime_lora_updating=True))
    with serve_in_thread(app) as base:
        done = subprocess.run([exe, "run", f"{base}/openapi.json", "--checks", "all",
                               "--include-path-regex", "lora_adapter|/v1/models",
                               "--max-examples", "20", "--seed", "1", "--no-color",
                               "--output-sanitize", "false"], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
    out = done.stdout
    assert "Tested: 4" in out and done.returncode == 0 and "Failures:" not in out, out[-3000:]


@pytest.mark.parametrize("options, engine_kind, words", [
    (dict(lora_modules=["a=/no/such/dir"]), "lora", "--lora-modules: LoRA adapter 'a'"),
    (dict(lora_modules=["a"]), "lora", "expected NAME=PATH"),
    (dict(lora_modules=["tiny=/x"]), "lora", "given twice"),
    (dict(lora_modules=["a=/x"]), "plain", "--lora-modules needs"),
    (dict(allow_runtime_lora_updating=True), "plain", "--allow-runtime-lora-updating needs")],
    ids=["bad-path", "no-equals", "base-name", "no-enable-lora", "runtime-no-enable-lora"])
def test_bad_lora_options_fail_the_start_in_one_line(spare_engine, tiny_model, options,
                                                     engine_kind, words):
    engine = spare_engine if engine_kind == "lora" else plain_engine(tiny_model)
    with pytest.raises(KvslimError) as e:
        build_app(engine, "tiny", options=ServerOptions(**options))
    assert words in str(e.value) and "\n" not in str(e.value)


def plain_engine(path) -> LLMEngine:
    return LLMEngine(path, EngineConfig(kv_cache_memory="4MiB", dtype="float32", device="cpu"))


@pytest.mark.parametrize("flags, words", [
    (["--lora-modules", "a=/x"], "--lora-modules needs an engine with LoRA adapters"),
    (["--enable-lora", "--lora-modules", "a=/no/such/dir"],
     "--lora-modules: LoRA adapter 'a' (/no/such/dir): no adapter_config.json")],
    ids=["no-enable-lora", "bad-path"])
def test_kvslim_serve_refuses_bad_lora_modules_in_one_line(tiny_model, capsys, flags, words):
    argv = ["serve", str(tiny_model), "--kv-cache-memory", "4MiB", "--dtype", "float32",
            "--device", "cpu", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvslim serve: error: ") and words in err[-1], err


def test_serve_flags():
    args = build_parser().parse_args(["serve", "m", "--enable-lora", "--max-loras", "2",
                                      "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                                      "--allow-runtime-lora-updating"])
    assert args.lora_modules == ["a=/x", '{"name": "b", "path": "/y"}']
    assert [parse_module(m) for m in args.lora_modules] == [("a", "/x"), ("b", "/y")]
    assert args.allow_runtime_lora_updating and args.enable_lora and args.max_loras == 2
    args = build_parser().parse_args(["serve", "m"])
    assert args.lora_modules is None and not args.allow_runtime_lora_updating
