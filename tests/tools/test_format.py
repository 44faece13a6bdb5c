"""The pieces every tool-call format shares: a decoded JSON value read as a call, and the
forcing grammars' closed schemas."""
import json

from kvslim.tools.format import call_of, closed, decode_json


def test_call_of_reads_only_calls_of_the_tools():
    names = {"f"}
    assert call_of({"name": "f", "arguments": {"a": 1}}, names).arguments == '{"a": 1}'
    assert call_of({"name": "f", "arguments": '{"a": 1}'}, names).arguments == '{"a": 1}'
    assert call_of({"name": "f"}, names).arguments == "{}"
    assert call_of({"name": "f", "parameters": {"b": "é"}}, names,
                   ("parameters", "arguments")).arguments == '{"b": "é"}'
    assert call_of({"name": "f", "args": {}}, names, new_id=lambda: "abc").id == "abc"
    for bad in [{"name": "g", "arguments": {}}, {"arguments": {}}, ["f"], "f",
                {"name": "f", "arguments": "not json"}, {"name": "f", "arguments": [1]},
                {"name": "f", "arguments": "[1]"}]:
        assert call_of(bad, names) is None, bad


def test_decode_json_waits_for_the_closing_bracket():
    text = '{"a": [1, {"b": "}"}]} rest'
    ends = [i for i in range(len(text) + 1) if decode_json(text[:i], 0) is not None]
    assert ends == list(range(text.index(" rest"), len(text) + 1))
    assert decode_json(text, 0) == (json.loads(text[:-5]), len(text) - 5)
    assert decode_json('{"a": }', 0) is None


def test_closed_adds_additional_properties_only_where_unsaid():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object",
                                                     "additionalProperties": True}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["additionalProperties"] is True
    assert "additionalProperties" not in schema                  # the input is not changed
