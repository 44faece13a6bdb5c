"""SchemaShape: the shortest value of each kind of schema, and the schemas closing cannot follow
(their answers closed by syntax alone) named as such."""
import pytest

from kvslim.structured.grammar import GrammarCompiler
from kvslim.structured.json_closer import JsonCloser
from kvslim.structured.params import StructuredOutputsParams
from kvslim.structured.schema_closer import SchemaCloser
from kvslim.structured.schema_shape import SchemaShape, Unsupported
from kvslim.tokenizer.tokenizer import Tokenizer


@pytest.mark.parametrize("schema, shortest", [
    ({}, b"null"), ({"type": "object"}, b"{}"), ({"type": "string", "minLength": 3}, b'"aaa"'),
    ({"type": "integer", "minimum": 1000, "maximum": 2100}, b"1000"),
    ({"type": "integer", "exclusiveMinimum": 5}, b"6"),
    ({"type": "number", "minimum": 0.25, "maximum": 0.75}, b"0.5"),
    ({"type": "integer", "minimum": -9, "maximum": -2}, b"-2"),
    ({"enum": ["XL", "S", 10]}, b"10"), ({"enum": ["XL", "S"]}, b'"S"'), ({"const": 1}, b"1"),
    ({"type": ["boolean", "null"]}, b"true"), ({"anyOf": [{"type": "array"}, {"type": "null"}]},
                                               b"[]"),
    ({"type": "array", "items": {"enum": ["ab"]}, "minItems": 2}, b'["ab","ab"]'),
    ({"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "string"}},
      "required": ["a", "b"]}, b'{"b":true,"a":""}'),
    ({"$defs": {"t": {"type": "object", "properties": {"k": {"$ref": "#/$defs/t"}}}},
      "$ref": "#/$defs/t"}, b"{}"),
])
def test_the_shortest_value_of_each_kind(schema, shortest):
    assert SchemaShape(schema).root.min == shortest


UNSUPPORTED = [
    {"type": "string", "pattern": "^[A-Z]{2}$"}, {"type": "string", "format": "date"},
    {"allOf": [{"type": "object"}]}, {"type": "integer", "multipleOf": 3},
    {"anyOf": [{"type": "object"}, {"type": "object", "required": ["a"],
                                    "properties": {"a": {}}}]},
    {"type": "object", "required": ["a"]}, {"type": ["integer", "number"]},
    {"type": "array", "items": [{"type": "string"}]},
    {"type": "object", "x-guidance": {"whitespace_pattern": " "}},
    {"$defs": {"t": {"type": "object", "properties": {"k": {"$ref": "#/$defs/t"}},
                     "required": ["k"]}}, "$ref": "#/$defs/t"},
    {"properties": {"a": {"type": "string"}}},
]


@pytest.mark.parametrize("schema", UNSUPPORTED)
def test_what_closing_cannot_follow_is_closed_by_syntax(hf_checkpoints, schema):
    with pytest.raises(Unsupported):
        SchemaShape(schema)
    compiler = GrammarCompiler(Tokenizer.from_dir(hf_checkpoints["gqa"]), 320, [0])
    grammar = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.shape(grammar) is None
    assert type(compiler.closer(compiler.shape(grammar))) is JsonCloser


def test_a_schema_closing_follows_gets_a_schema_closer(hf_checkpoints):
    compiler = GrammarCompiler(Tokenizer.from_dir(hf_checkpoints["gqa"]), 320, [0])
    grammar = compiler.compile(StructuredOutputsParams(json={"type": "object"}))
    assert isinstance(compiler.closer(compiler.shape(grammar)), SchemaCloser)
    any_object = compiler.compile(StructuredOutputsParams(json_object=True))
    assert compiler.shape(any_object) is None                 # the syntax's closing, as before
