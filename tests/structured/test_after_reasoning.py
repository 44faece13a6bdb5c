"""Structured outputs behind a reasoning parser's thinking: the grammar lets the thinking run free
up to the first </think> (required where the prompt opens it, optional where the model opens it)
and binds the answer after it; the closer sees the answer's bytes however tokens cut them; in the
engine, the thinking is the model's own unconstrained text, and a budget that runs out ends the
thinking and still leaves an answer that validates."""
import json

import jsonschema
import pytest

from engine.engine_helpers import engine, run
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError
from kvslim.reasoning.parser import MODEL_OPENS, PROMPT_OPENS
from kvslim.structured.after_reasoning import ThinkingCloser
from kvslim.structured.grammar import GrammarCompiler
from kvslim.structured.json_closer import JsonCloser
from kvslim.structured.params import StructuredOutputsParams
from kvslim.tokenizer.tokenizer import Tokenizer
from structured.test_structured_engine import PROMPTS, shortest

ANSWER = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CONSTRAINTS = {"json": dict(json=ANSWER), "choice": dict(choice=["yes", "no"]),
               "regex": dict(regex="[0-9]+"), "grammar": dict(grammar='root ::= "x" "y"')}
# (text, the constraints it satisfies with the prompt opening the thinking, with the model)
TEXTS = [
    ('I think a=3.</think>\n\n{"a": 3}', {"json"}, set()),
    ('<think>{"a": {x}}</think>{"a":1}', {"json"}, {"json"}),
    ('{"a": 2}', set(), {"json"}),
    ("hm</think>yes", {"choice"}, set()),
    ("\n<think>42 or 7?</think>42", {"regex"}, {"regex"}),
    ("xy", set(), {"grammar"}),
    ("</think>xy", {"grammar"}, set()),
    ("</think>\n\nyes", set(), set()),                 # blanks lead JSON answers only
    ("</think>x</think>y", set(), set()),              # the first </think> ends the thinking
]


@pytest.fixture(scope="module")
def compiler(hf_checkpoints):
    tokenizer = Tokenizer.from_dir(hf_checkpoints["gqa"])
    return GrammarCompiler(tokenizer, 320, [0]), tokenizer


@pytest.mark.parametrize("fmt", [PROMPT_OPENS, MODEL_OPENS], ids=["prompt", "model"])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_the_grammar_binds_the_answer_after_the_thinking(compiler, fmt, kind):
    compiler, tokenizer = compiler
    grammar = compiler.compile(StructuredOutputsParams(**CONSTRAINTS[kind], reasoning=fmt))
    for text, by_prompt, by_model in TEXTS:
        matcher = compiler.matcher(grammar)
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()
        assert ok == (kind in (by_prompt if fmt.opened_by_prompt else by_model)), text


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 40])
def test_the_closer_is_fed_the_answer_however_tokens_cut_it(cut):
    text = b'<think>\nthe </thin order {"a": [</think>\n{"a": [1, {"b": "c'
    closer = ThinkingCloser(JsonCloser(), PROMPT_OPENS)
    closings = []
    for i in range(0, len(text), cut):
        closings.append(closer.closing())
        closer.feed(text[i:i + cut])
    end = text.index(b"</think>") + len(b"</think>")
    assert closings[0] == b"</think>{}"
    assert [c.startswith(b"</think>") for c in closings] == [
        fed < end for fed in range(0, len(text), cut)]
    assert not closer.thinking and closer.closing() == b'"}]}'
    alone = JsonCloser()
    alone.feed(b'\n{"a": [1, {"b": "c')
    assert closer.inner.closing() == alone.closing()


def test_a_model_that_does_not_open_the_thinking_answers_at_once():
    closer = ThinkingCloser(JsonCloser(), MODEL_OPENS)
    assert closer.closing() == b"{}"
    closer.feed(b'  {"a"')
    assert not closer.thinking and closer.closing() == b":null}"


def _after(fmt, schema=ANSWER):
    return StructuredOutputsParams(json=schema, reasoning=fmt)


@pytest.mark.parametrize("max_tokens", [20, 24, 31])
def test_the_thinking_is_free_and_a_cut_budget_still_validates(hf_checkpoints, max_tokens):
    """A random model never writes </think>: it thinks its own greedy text (held to valid
    UTF-8 and without EOS, as any text is under a grammar) until closing is due, then </think>
    and the shortest answer are written."""
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    free = run(eng, PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                            ignore_eos=True,
                                            structured_outputs={"regex": "(?s:.*)"}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            structured_outputs=_after(PROMPT_OPENS))
    for plain, out in zip(free, run(eng, PROMPTS, params)):
        c = out.outputs[0]
        reasoning, answer = PROMPT_OPENS.split(c.text)
        jsonschema.validate(json.loads(answer), ANSWER)
        # Past the free text: at most a cut character's rest, then the closing.
        free_len = next(i for i, (a, b) in enumerate(zip(c.token_ids, plain.outputs[0].token_ids))
                        if a != b)
        closing = eng.grammar_compiler.token_bytes(c.token_ids[free_len:])
        tail = len(closing) - len(closing.lstrip(bytes(range(0x80, 0xC0))))
        assert tail <= 3 and closing[tail:].startswith(b"</think>"), closing
        assert reasoning and c.finish_reason == "length" and len(c.token_ids) <= max_tokens
    assert not eng.structured.closers and not eng.structured.reasoning


@pytest.mark.parametrize("max_tokens", [8, 16, 30])
def test_an_answer_without_thinking_is_bound_from_its_first_token(hf_checkpoints, max_tokens):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=max_tokens, n=2,
                            structured_outputs=_after(MODEL_OPENS))
    for c in [c for o in run(eng, PROMPTS, params) for c in o.outputs]:
        _, answer = MODEL_OPENS.split(c.text)
        jsonschema.validate(json.loads(answer), ANSWER)
        assert len(c.token_ids) <= max_tokens


def test_a_budget_without_room_to_end_the_thinking_is_refused(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4)
    need = shortest(eng, ANSWER) + len(eng.grammar_compiler.closing_tokens(b"</think>"))
    with pytest.raises(InvalidRequestError, match=rf"max_tokens \({need - 1}\) is too small.*"
                                                  r"tokens that end the thinking") as e:
        eng.add_request(PROMPTS[0], SamplingParams(max_tokens=need - 1,
                                                   structured_outputs=_after(PROMPT_OPENS)))
    assert e.value.param == "max_tokens" and not eng.structured.grammars
    out = run(eng, PROMPTS[:1], SamplingParams(max_tokens=need, temperature=0.0,
                                               structured_outputs=_after(PROMPT_OPENS)))
    reasoning, answer = PROMPT_OPENS.split(out[0].outputs[0].text)
    assert reasoning is None and json.loads(answer)
