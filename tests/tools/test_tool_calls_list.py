"""Mistral's tool calls: what Mistral's own chat templates write — v0.3's `[TOOL_CALLS] [...]`
list (Mistral 7B Instruct v0.3) and the `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` form (Small
3.2) — parses back to exactly those calls, whole and cut at every boundary, also with the
markers dropped as Mistral's tokenizer decodes them; calls get the nine-character ids the
templates demand on the next turn; what is not a call is text; the forcing grammar admits
exactly calls, and what it admits parses back."""
import json
import re

import pytest

from kvslim.tools.chat import ToolRequest, encode_chat_with_tools
from kvslim.tools.tool_calls_list import FORMAT, TOOL_CALLS
from tool_checks import (TIME, TOOLS, USER, WEATHER, accepts, assistant_turn, cuts,
                         family_tokenizer, lark, openai_calls, stream)

OPENAI_TOOLS = [t.openai() for t in TOOLS]
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Europe/Paris"})]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def v03(hf_checkpoints):
    return family_tokenizer(hf_checkpoints["gqa"], "mistral_v0.3_instruct.jinja", SPECIALS)


@pytest.fixture(scope="module")
def small32(hf_checkpoints):
    return family_tokenizer(hf_checkpoints["gqa"], "mistral_small_3.2.jinja", SPECIALS)


def _turn(tok, calls) -> str:
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": openai_calls(calls, ["abcDEF123", "xyz789ABC"])}
    return assistant_turn(tok, USER, assistant, OPENAI_TOOLS, FORMAT, "</s>")


def _parsed(text: str):
    content, calls = FORMAT.parse(text, TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_v03_list_parses_back_with_or_without_its_marker(v03):
    turn = _turn(v03, CALLS)
    assert turn == ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                    '"unit": "c"}, "id": "abcDEF123"}, {"name": "get_time", "arguments": '
                    '{"tz": "Europe/Paris"}, "id": "xyz789ABC"}]')
    assert _parsed(turn) == (None, CALLS)
    assert _parsed(turn.replace(TOOL_CALLS, "")) == (None, CALLS)     # the special token dropped


def test_small32_named_form_parses_back(small32):
    turn = _turn(small32, CALLS)
    assert turn == ('[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris", "unit": '
                    '"c"}[TOOL_CALLS]get_time[CALL_ID]xyz789ABC[ARGS]{"tz": "Europe/Paris"}')
    assert _parsed(turn) == (None, CALLS)
    assert _parsed(turn.replace("[CALL_ID]abcDEF123", "")) == (None, CALLS)
    assert _parsed("Let me look. " + turn) == ("Let me look.", CALLS)


def test_streamed_at_every_cut_equals_whole(v03, small32):
    texts = [_turn(v03, CALLS), _turn(v03, CALLS).replace(TOOL_CALLS, ""),
             "Checking. " + _turn(small32, CALLS) + " Done.", "[1] is a citation, [TOOL",
             '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }}] then text']
    for text in texts:
        whole = stream(FORMAT, TOOLS, [text])
        assert whole[1] == [(c.name, c.arguments) for c in FORMAT.parse(text, TOOLS)[1]]
        for pieces in cuts(text):
            assert stream(FORMAT, TOOLS, pieces) == whole, pieces


def test_calls_get_ids_the_template_takes_back(v03):
    _, calls = FORMAT.parse(_turn(v03, CALLS), TOOLS)
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in calls)
    assert len({c.id for c in calls}) == 2
    history = USER + [{"role": "assistant", "content": None,
                       "tool_calls": [c.openai() for c in calls]},
                      {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C"},
                      {"role": "tool", "tool_call_id": calls[1].id, "content": "14:05"}]
    request = ToolRequest.of(OPENAI_TOOLS, "auto", format=FORMAT)
    text = v03.decode(encode_chat_with_tools(v03, history, request), skip_special_tokens=False)
    assert text.endswith(f'[TOOL_RESULTS] {{"content": 14:05, "call_id": "{calls[1].id}"}}'
                         "[/TOOL_RESULTS]")


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }}]',          # bad JSON
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}',    # never closed
    '[TOOL_CALLS] [{"name": "get_wether", "arguments": {"city": "Paris"}}]',    # unknown
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}, 3]',       # not all calls
    '[TOOL_CALLS] []',
    '[TOOL_CALLS]get_weather[ARGS]"Paris"',                                     # not an object
    '[TOOL_CALLS]get_weather{"city": "Paris"}',                                 # no [ARGS]
    ' [{"city": "Paris"}]',                                                     # a JSON answer
    "[1] is a citation.",
])
def test_what_is_not_a_call_is_text(text):
    assert FORMAT.parse(text, TOOLS) == (text, [])


def test_plain_text_streams_at_once_but_a_possible_marker_waits():
    parser = FORMAT.stream_parser(TOOLS)
    assert parser.feed(" [") == [] and parser.feed("1] a [TOOL") == [" [1] a "]
    assert parser.feed("S") == ["[TOOLS"] and parser.finish() == []


@pytest.mark.parametrize("parallel", [False, True])
def test_the_forcing_grammar_admits_only_calls_and_they_parse_back(parallel):
    grammar = lark(FORMAT, TOOLS, parallel)
    one = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    two = f'{TOOL_CALLS} [{one}, {{"name": "get_time", "arguments": {{"tz": "UTC"}}}}]'
    assert accepts(grammar, f"{TOOL_CALLS} [{one}]")
    assert accepts(grammar, two) == parallel
    assert _parsed(two) == (None, [("get_weather", {"city": "Oslo", "unit": "c"}),
                                   ("get_time", {"tz": "UTC"})])
    for bad in [one.replace("get_weather", "get_wether"),              # unknown function
                one.replace('"unit": "c"', '"unit": "k"'),            # outside the enum
                one.replace('{"city": "Oslo", "unit": "c"}', '{"unit": "c"}'),   # required
                one.replace('"unit": "c"', '"unit": "c", "extra": 1'),  # closed objects
                one.replace("arguments", "parameters")]:              # Llama's key
        assert not accepts(grammar, f"{TOOL_CALLS} [{bad}]"), bad
    assert not accepts(grammar, f"[{one}]") and not accepts(grammar, f"Sure {TOOL_CALLS} [{one}]")


@pytest.fixture(scope="module")
def marked_checkpoint(hf_checkpoints, tmp_path_factory):
    """The test checkpoint with `[TOOL_CALLS]` and `[ARGS]` as special tokens (ids 300, 301),
    as Mistral's tokenizers have them."""
    source = hf_checkpoints["gqa"]
    model = tmp_path_factory.mktemp("marked")
    for f in source.iterdir():
        if f.name != "tokenizer.json":
            (model / f.name).symlink_to(f)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer["added_tokens"] += [
        {"id": 300 + i, "content": marker, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, marker in enumerate((TOOL_CALLS, "[ARGS]"))]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


def test_llm_chat_keeps_the_special_markers_and_reads_the_call(marked_checkpoint):
    """The model writes the markers as special tokens (a grammar picks them by id): the
    answer's text keeps them, so the call is read; without tools they are dropped as usual."""
    from kvslim.engine.llm import LLM
    from kvslim.engine.sampling_params import SamplingParams
    from kvslim.structured.params import StructuredOutputsParams
    llm = LLM(str(marked_checkpoint), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    writes = StructuredOutputsParams(grammar='start: <[300]> "get_time" <[301]> '
                                             '"{\\"tz\\": \\"UTC\\"}"')
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=writes)
    out = llm.chat(USER, params, use_tqdm=False, tools=[TIME.openai()],
                   tool_call_parser="mistral")[0].outputs[0]
    assert out.text == '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_time", {"tz": "UTC"})]
    plain = llm.chat(USER, params, use_tqdm=False)[0].outputs[0]
    assert plain.text == 'get_time{"tz": "UTC"}' and plain.tool_calls is None
