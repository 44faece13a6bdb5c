"""Structured outputs through the official openai client: on the shared tiny server, each
constraint field in completions and chat, streamed or not; on SmolLM2, the fifty schemas of
lab/kvslim_lab/bench/schema_suite.py, every answer parsed and validated with jsonschema, streamed and not,
json_object answers that parse whenever they end, and json_schema answers that parse and
validate at every max_tokens from the least their schema needs (one less is a 400)."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from kvslim_lab.bench.schema_suite import schema_suite

REGEX = r"(the|a) (kernel|memory|wife|man) (is|was) (good|in want|managed)\."


def _chat(client, stream: bool, **extra):
    messages = [{"role": "user", "content": "Tell me about the kernel."}]
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=120,
                                           temperature=0, **extra)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 max_tokens=40, temperature=0, **extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("field", ["structured_outputs", "guided_regex"])
def test_regex_in_chat(client, stream, field):
    body = {"structured_outputs": {"regex": REGEX}} if field == "structured_outputs" \
        else {"guided_regex": REGEX}
    text, finish = _chat(client, stream, extra_body=body)
    assert re.fullmatch(REGEX, text), text
    assert finish == "stop"


def test_choice_and_grammar_in_completions(client):
    r = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=10,
                                  temperature=0.9, n=4, seed=1,
                                  extra_body={"guided_choice": ["kernel", "memory", "wife"]})
    assert {c.text for c in r.choices} <= {"kernel", "memory", "wife"}
    grammar = 'root ::= "pages of " [0-9] [0-9]? " bytes"'
    stream = client.completions.create(model="tiny", prompt="memory is managed in", stream=True,
                                       max_tokens=20, temperature=0,
                                       extra_body={"guided_grammar": grammar})
    text = "".join(c.choices[0].text for c in stream)
    assert re.fullmatch(r"pages of [0-9][0-9]? bytes", text), text


def test_json_object_on_the_tiny_model_parses(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    text, finish = _chat(client, False, response_format={
        "type": "json_schema", "json_schema": {"name": "ok", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(text), schema)


# ---- SmolLM2: the fifty schemas ----------------------------------------------------------
async def _create(client, stream: bool, **common) -> tuple[str, str]:
    """A chat answer's text and finish_reason, whole or put together from its stream."""
    if not stream:
        r = await client.chat.completions.create(**common)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **common):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


async def _answer(client, case, stream: bool, response_format) -> tuple[str, str]:
    messages = [{"role": "user", "content": case.prompt}]
    common = dict(model="tiny", messages=messages, max_tokens=300, temperature=0,
                  response_format=response_format)
    return await _create(client, stream, **common)


def _json_schema(case):
    return {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema,
                                                   "strict": True}}


async def _all(url: str, jobs):
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=600) as client:
        return await asyncio.gather(*[_answer(client, *job) for job in jobs])


def test_fifty_json_schemas_parse_and_validate_streamed_and_not(smol_server):
    cases = schema_suite()
    assert len(cases) == 50 and len({json.dumps(c.schema) for c in cases}) == 10
    jobs = [(c, stream, _json_schema(c)) for stream in (False, True) for c in cases]
    answers = asyncio.run(_all(smol_server.url, jobs))
    failures = []
    for (case, stream, _), (text, finish) in zip(jobs, answers):
        try:
            jsonschema.validate(json.loads(text), case.schema)
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{case.name} stream={stream} {finish}: {text!r}: {e}")
    assert not failures, "\n".join(failures)
    whole, streamed = answers[:50], answers[50:]
    assert whole == streamed                  # greedy: the same answer either way


def test_json_object_answers_that_end_parse(smol_server):
    """The grammar guarantees JSON up to where the answer stops; greedy SmolLM2 repeats itself
    inside some objects until max_tokens (docs/structured_outputs.md counts how often), so only
    the answers that end (finish_reason "stop") can be whole, and every one of them parses."""
    cases = [c for c in schema_suite()][::5]
    answers = asyncio.run(_all(smol_server.url,
                               [(c, False, {"type": "json_object"}) for c in cases]))
    ended = [text for text, finish in answers if finish == "stop"]
    assert len(ended) >= len(cases) // 2, answers
    for text in ended:
        assert isinstance(json.loads(text), dict), text
    for text, finish in answers:
        assert finish in ("stop", "length") and text.lstrip().startswith("{")


# ---- SmolLM2: a json_schema answer parses whatever max_tokens ends it ----------------------
ITEM = {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}
CLOSED = {
    # The report: greedy SmolLM2 runs a digit string inside "sku" until the budget is gone.
    "skus": {"type": "object", "properties": {"items": {"type": "array", "items": ITEM}},
             "required": ["items"]},
    # Each item's string is followed by required fields: the string's own closing quote is
    # not a closing the schema accepts.
    "order": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1,
              "items": {"type": "object", "properties": {
                  "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                  "size": {"enum": ["small", "large"]}},
                  "required": ["sku", "qty", "size"], "additionalProperties": False}}},
              "required": ["items"], "additionalProperties": False},
    "grid": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2},
        "rows": {"type": "array", "minItems": 1, "items": {
            "type": "array", "minItems": 2, "items": {"type": "number", "minimum": 0.5,
                                                      "maximum": 9}}},
        "unit": {"enum": ["cm", "inch"]}}, "required": ["name", "rows", "unit"]},
}


@pytest.fixture(scope="module")
def smol_compiler(smollm2_dir):
    """The server's tokenization of a closing: what the least max_tokens of a schema is."""
    from kvslim.models.config import ModelConfig
    from kvslim.structured.grammar import GrammarCompiler
    from kvslim.tokenizer.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    return GrammarCompiler(tokenizer, ModelConfig.from_dir(smollm2_dir).vocab_size,
                           tokenizer.eos_token_ids)


async def _order(client, schema, max_tokens: int, stream: bool) -> tuple[str, str]:
    common = dict(model="tiny", messages=[{"role": "user", "content": "Make a small shopping "
                                           "order."}], max_tokens=max_tokens, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "order", "schema": schema, "strict": True}})
    return await _create(client, stream, **common)


async def _orders(url: str, jobs):
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=600) as client:
        return await asyncio.gather(*[_order(client, *job) for job in jobs],
                                    return_exceptions=True)


def test_json_schema_answers_parse_whatever_max_tokens_ends_them(smol_server, smol_compiler):
    from kvslim.structured.schema_shape import SchemaShape
    shortest = {name: SchemaShape(schema).root.min for name, schema in CLOSED.items()}
    least = {name: len(smol_compiler.closing_tokens(text)) for name, text in shortest.items()}
    jobs = [(name, m, stream) for name in CLOSED for stream in (False, True)
            for m in range(least[name] - 1, 61)]
    answers = asyncio.run(_orders(smol_server.url, [(CLOSED[n], m, s) for n, m, s in jobs]))
    texts = {}
    for (name, max_tokens, stream), answer in zip(jobs, answers):
        if max_tokens < least[name]:                      # refused before it runs
            assert isinstance(answer, openai.BadRequestError), answer
            assert answer.body["param"] == "max_tokens"
            assert answer.body["message"] == (
                f"max_tokens ({max_tokens}) is too small for the JSON schema: its shortest "
                f"JSON, {shortest[name].decode()}, takes {least[name]} tokens")
            continue
        text, finish = answer
        jsonschema.validate(json.loads(text), CLOSED[name])
        assert finish in ("stop", "length"), finish
        texts.setdefault((name, max_tokens), []).append(text)
    assert sum(map(len, texts.values())) == 2 * sum(61 - n for n in least.values())
    assert all(whole == streamed for whole, streamed in texts.values())   # greedy: the same
    assert json.loads(texts["skus", 60][0])["items"][0]["sku"]   # the model's digits, closed
