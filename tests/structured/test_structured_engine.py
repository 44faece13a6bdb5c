"""Constrained decoding in the engine, on a tiny random model (whose unconstrained output is
noise, so whatever matches did so because of the mask): regex, choice and JSON outputs match;
greedy output is the same alone and batched, under preemption, with prefix-cache hits and with
speculative drafts; nothing is left behind after the end or an abort. A JSON answer that would
run into max_tokens is closed instead: it parses, and only its end differs; a schema's answer
validates at every max_tokens from the least its schema takes (one less is refused)."""
import json
import re

import jsonschema
import pytest

from engine.engine_helpers import engine, run
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError
from structured.schema_instances import SCHEMAS

PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, list(range(40, 60)), [3, 1, 4, 1, 5, 9],
           [100 + (i % 7) for i in range(30)]]
REGEX = r"(the|a) (kernel|memory|wife|man)( (is|was) (good|in want|managed))?\."
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["kernel", "memory"]}, "pages": {"type": "integer", "minimum": 0,
                                                    "maximum": 4096},
    "ok": {"type": "boolean"}}, "required": ["kind", "pages", "ok"],
    "additionalProperties": False, "x-guidance": {"whitespace_pattern": "[ ]?"}}


def constrained(max_tokens=40, **extra):
    extra.setdefault("temperature", 0.0)
    constraint = extra.pop("constraint", {"regex": REGEX})
    return SamplingParams(max_tokens=max_tokens, structured_outputs=constraint, **extra)


def texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


def assert_clean(eng):
    assert not eng.structured.grammars and not eng.structured.matchers
    assert not eng.runner.sampler.penalties


@pytest.mark.parametrize("params", [
    dict(), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_k=20, n=3, seed=1)],
    ids=["greedy", "sampled", "n3"])
def test_regex_output_matches(hf_checkpoints, params):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    outs = run(eng, PROMPTS, constrained(**params))
    for out in outs:
        for c in out.outputs:
            assert re.fullmatch(REGEX, c.text), c.text
            assert c.finish_reason == "stop"
    assert_clean(eng)


def test_choice_and_json_schema(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    choice = run(eng, PROMPTS, constrained(constraint={"choice": ["kernel", "memory page"]}))
    assert set(texts(choice)) <= {"kernel", "memory page"}
    outs = run(eng, PROMPTS, constrained(max_tokens=60, constraint={"json": SCHEMA},
                                         temperature=1.0, seed=0, n=2))
    for text in texts(outs):
        jsonschema.validate(json.loads(text), SCHEMA)
    unconstrained = run(eng, PROMPTS[:1], SamplingParams(max_tokens=20, temperature=0.0))
    assert not re.fullmatch(REGEX, texts(unconstrained)[0])     # the mask did the work
    assert_clean(eng)


def test_greedy_output_is_the_same_alone_batched_and_with_plain_neighbours(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    alone = [texts(run(eng, [p], constrained()))[0] for p in PROMPTS]
    mixed = [constrained() if i % 2 == 0 else SamplingParams(max_tokens=30, temperature=0.0)
             for i in range(8)]
    together = texts(run(eng, PROMPTS + PROMPTS, mixed))
    assert together[0::2] == [alone[0], alone[2], alone[0], alone[2]]
    assert_clean(eng)


def test_preemption_and_prefix_cache_hits_change_nothing(hf_checkpoints):
    ample = engine(hf_checkpoints["gqa"], block_size=4)
    expected = texts(run(ample, PROMPTS, constrained()))
    memory = 24 * ample.runner.bytes_per_block            # 24 blocks of 4 tokens
    tight = engine(hf_checkpoints["gqa"], block_size=4, kv_cache_memory=memory)
    assert texts(run(tight, PROMPTS, constrained())) == expected
    assert tight.kv_cache_stats().num_preemptions > 0
    cached = engine(hf_checkpoints["gqa"], block_size=4, enable_prefix_caching=True)
    run(cached, PROMPTS, constrained())
    assert texts(run(cached, PROMPTS, constrained())) == expected
    assert cached.kv_cache_stats().prefix_cache_hits > 0
    assert_clean(tight)


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_drafts_are_checked_against_the_grammar(hf_checkpoints, k):
    plain = engine(hf_checkpoints["gqa"], block_size=4)
    spec = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                prompt_lookup_max=3, disable_by_batch_size=None)
    fast = engine(hf_checkpoints["gqa"], block_size=4, speculative=spec)
    # Repetitive text the n-gram proposer can copy from: its drafts are often forbidden.
    regex = r"(kernel|memory)( (kernel|memory)){2,5}\."
    params = constrained(max_tokens=60, constraint={"regex": regex})
    expected = texts(run(plain, PROMPTS, params))
    assert texts(run(fast, PROMPTS, params)) == expected
    assert all(re.fullmatch(regex, t) for t in expected)
    assert fast.spec_decode_stats().num_draft_tokens > 0
    assert_clean(fast)


JSON_OBJECT = {"json_object": True}


@pytest.mark.parametrize("max_tokens", [2, 5, 12, 30])
def test_json_answers_parse_whatever_max_tokens_is(hf_checkpoints, max_tokens):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    outs = run(eng, PROMPTS, constrained(max_tokens=max_tokens, constraint=JSON_OBJECT,
                                         temperature=1.0, seed=5, n=3))
    for c in [c for o in outs for c in o.outputs]:
        assert isinstance(json.loads(c.text), dict), c.text
        assert len(c.token_ids) <= max_tokens
    assert_clean(eng)
    assert not eng.structured.closers and not eng.structured.forced


def test_closing_changes_only_the_end_of_an_answer(hf_checkpoints):
    from kvslim.structured.json_closer import JsonCloser
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    long = run(eng, PROMPTS, constrained(max_tokens=120, constraint=JSON_OBJECT))
    short = run(eng, PROMPTS, constrained(max_tokens=24, constraint=JSON_OBJECT))
    as_bytes, growth = eng.grammar_compiler.token_bytes, eng.grammar_compiler.json_growth
    closed = 0
    for whole, cut in zip(long, short):
        a, b = whole.outputs[0].token_ids, cut.outputs[0].token_ids
        if b and b[-1] in eng.eos_token_ids:              # the grammar's end, then EOS
            b = b[:-1]
        if whole.outputs[0].finish_reason == "stop" and len(a) <= 24 - growth:
            assert b == a                                 # ended well within the budget
            continue
        k = next(i for i in range(len(b) + 1) if i == len(b) or b[i] != a[i])
        closer = JsonCloser()
        closer.feed(as_bytes(a[:k]))
        assert as_bytes(b) == as_bytes(a[:k]) + closer.closing()
        assert k >= 24 - len(closer.closing()) - growth   # closing began only when due
        assert cut.outputs[0].finish_reason == "length"
        closed += 1
    assert closed                                         # the random model rambles


def test_speculative_drafts_change_no_closed_answer(hf_checkpoints):
    params = constrained(max_tokens=20, constraint=JSON_OBJECT)
    expected = texts(run(engine(hf_checkpoints["gqa"], block_size=4), PROMPTS, params))
    spec = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                prompt_lookup_max=3, disable_by_batch_size=None)
    fast = engine(hf_checkpoints["gqa"], block_size=4, speculative=spec)
    assert texts(run(fast, PROMPTS, params)) == expected
    assert fast.spec_decode_stats().num_draft_tokens > 0
    assert_clean(fast)


def test_abort_mid_generation_forgets_the_matchers(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    request = eng.add_request(PROMPTS[0], constrained(max_tokens=60, n=2, temperature=1.0))
    for _ in range(4):
        eng.step()
    assert eng.structured.matchers
    eng.abort_request(request)
    assert_clean(eng)
    assert eng.kv_cache_stats().num_used_blocks == 0


def test_a_schema_the_library_refuses_is_refused_before_queueing(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    bad = SamplingParams(structured_outputs={"json": {"type": "object",
                                                      "properties": {"a": {"type": "nope"}}}})
    with pytest.raises(InvalidRequestError, match="JSON schema") as e:
        eng.add_request(PROMPTS[0], bad)
    assert e.value.param == "structured_outputs"
    assert not eng.has_unfinished_requests() and not eng.structured.grammars


def test_the_compiled_step_gives_the_same_constrained_output(hf_checkpoints, monkeypatch):
    from kvslim.engine import cpu_compile
    monkeypatch.setattr(cpu_compile, "BACKEND", "aot_eager")    # the same graph, traced fast
    eager = engine(hf_checkpoints["gqa"], block_size=4)
    compiled = engine(hf_checkpoints["gqa"], block_size=4, compile_decode=True)
    params = [constrained(), constrained(constraint={"json": SCHEMA}, max_tokens=60),
              constrained(temperature=0.7, seed=2, n=2), SamplingParams(max_tokens=20)]
    assert texts(run(compiled, PROMPTS, params)) == texts(run(eager, PROMPTS, params))
    assert compiled.runner.decode_graphs.compilations > 0
    assert_clean(compiled)


# ---- a schema's answers close as the schema asks --------------------------------------------
# A string, then a required number: the random model never closes the string by itself, and the
# syntax alone ('"}') is not what the schema accepts there.
NOTE = {"type": "object", "properties": {"note": {"type": "string"},
                                         "pages": {"type": "integer", "minimum": 10}},
        "required": ["note", "pages"], "additionalProperties": False}
CLOSED_SCHEMAS = {"note": NOTE, **SCHEMAS}


def shortest(eng, schema) -> int:
    """The tokens of the shortest JSON the schema allows: the least max_tokens it takes."""
    from kvslim.structured.schema_shape import SchemaShape
    return len(eng.grammar_compiler.closing_tokens(SchemaShape(schema).root.min))


@pytest.mark.parametrize("name", list(CLOSED_SCHEMAS))
def test_schema_answers_validate_whatever_max_tokens_is(hf_checkpoints, name):
    schema = CLOSED_SCHEMAS[name]
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    budgets = range(shortest(eng, schema), 61)
    outs = run(eng, [PROMPTS[i % 4] for i in range(len(budgets))],
               [constrained(max_tokens=m, constraint={"json": schema}, temperature=1.0, seed=m)
                for m in budgets])
    for max_tokens, out in zip(budgets, outs):
        c = out.outputs[0]
        jsonschema.validate(json.loads(c.text), schema)
        assert len(c.token_ids) <= max_tokens
    assert sum(o.outputs[0].finish_reason == "length" for o in outs) > len(budgets) // 2
    assert_clean(eng)
    assert not eng.structured.closers and not eng.structured.forced


def test_a_budget_below_the_shortest_json_is_refused_before_queueing(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    need = shortest(eng, NOTE)
    with pytest.raises(InvalidRequestError, match=rf"max_tokens \({need - 1}\) is too small") as e:
        eng.add_request(PROMPTS[0], constrained(max_tokens=need - 1, constraint={"json": NOTE}))
    assert e.value.param == "max_tokens"
    assert not eng.has_unfinished_requests() and not eng.structured.grammars
    assert texts(run(eng, PROMPTS[:1], constrained(max_tokens=need, constraint={"json": NOTE}))
                 ) == ['{"note":"","pages":10}']


def test_schema_closing_changes_only_the_end_of_an_answer(hf_checkpoints):
    from kvslim.structured.schema_closer import SchemaCloser
    from kvslim.structured.schema_shape import SchemaShape
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    params = dict(constraint={"json": NOTE}, temperature=1.0, seed=7)
    long = run(eng, PROMPTS, constrained(max_tokens=200, **params))
    short = run(eng, PROMPTS, constrained(max_tokens=30, **params))
    as_bytes = eng.grammar_compiler.token_bytes
    for whole, cut in zip(long, short):
        a, b = whole.outputs[0].token_ids, cut.outputs[0].token_ids
        if b[-1] in eng.eos_token_ids:                    # the grammar's end, then EOS
            b = b[:-1]
        k = next(i for i in range(len(b) + 1) if i == len(b) or b[i] != a[i])
        closer = SchemaCloser(SchemaShape(NOTE))
        closer.feed(as_bytes(a[:k]))
        assert as_bytes(b) == as_bytes(a[:k]) + closer.closing()
        assert cut.outputs[0].finish_reason == "length"


def test_speculative_drafts_change_no_schema_closed_answer(hf_checkpoints):
    plain = engine(hf_checkpoints["gqa"], block_size=4)
    params = constrained(max_tokens=shortest(plain, SCHEMAS["order"]) + 6,
                         constraint={"json": SCHEMAS["order"]})
    expected = texts(run(plain, PROMPTS, params))
    spec = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                prompt_lookup_max=3, disable_by_batch_size=None)
    fast = engine(hf_checkpoints["gqa"], block_size=4, speculative=spec)
    assert texts(run(fast, PROMPTS, params)) == expected
    for text in expected:
        jsonschema.validate(json.loads(text), SCHEMAS["order"])
    assert fast.spec_decode_stats().num_draft_tokens > 0
    assert_clean(fast)
