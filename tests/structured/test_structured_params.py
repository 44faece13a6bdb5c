"""StructuredOutputsParams and GrammarCompiler: exactly one constraint, errors that name the field,
the compiled-grammar cache."""
import pytest

from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError
from kvslim.structured.grammar import GrammarCompiler
from kvslim.structured.params import StructuredOutputsParams
from kvslim.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler(hf_checkpoints):
    return GrammarCompiler(Tokenizer.from_dir(hf_checkpoints["gqa"]), 320, [0])


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"),
    ({"regex": "a+", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "must be an object"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty list"),
    ({"regex": ""}, "regex must be a non-empty string"),
])
def test_exactly_one_well_formed_constraint(fields, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        StructuredOutputsParams(**fields, param="response_format")
    assert e.value.param == "response_format"


def test_sampling_params_takes_a_dict_and_names_unknown_fields():
    p = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert p.structured_outputs.kind == "json" and p.structured_outputs.json == {"type": "object"}
    with pytest.raises(InvalidRequestError, match="unknown structured output field.*jsn") as e:
        SamplingParams(structured_outputs={"jsn": {}})
    assert e.value.param == "structured_outputs"


@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "JSON schema"),
    ({"json": {"type": "string", "pattern": "(?<=a)b"}}, "JSON schema"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
])
def test_what_the_library_cannot_compile_is_an_error_naming_the_field(compiler, fields, message):
    with pytest.raises(InvalidRequestError, match=f"the {message}.* cannot be compiled") as e:
        compiler.compile(StructuredOutputsParams(**fields, param="guided_x"))
    assert e.value.param == "guided_x"
    assert "\n" not in str(e.value)


def test_compiled_grammars_are_cached_by_their_text(compiler):
    a = compiler.compile(StructuredOutputsParams(json={"type": "object", "required": ["x"]}))
    b = compiler.compile(StructuredOutputsParams(json={"required": ["x"], "type": "object"}))
    assert a is b                                         # the same key: keys are sorted
    assert compiler.compile(StructuredOutputsParams(regex="x+")) is not a


def test_a_gbnf_grammar_is_accepted(compiler):
    grammar = compiler.compile(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    matcher = compiler.matcher(grammar)
    assert not matcher.is_error()


def test_a_budget_below_the_shortest_json_is_refused(compiler):
    order = StructuredOutputsParams(json={"type": "object", "properties": {"items": {
        "type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}},
                                   "required": ["sku"]}}}, "required": ["items"]},
        param="response_format")
    need = len(compiler.closing_tokens(b'{"items":[]}'))
    assert compiler.compile(order, max_tokens=need)
    with pytest.raises(InvalidRequestError, match=rf"max_tokens \({need - 1}\) is too small for "
                       rf"the JSON schema: its shortest JSON, {{\"items\":\[\]}}, takes {need} "
                       "tokens") as e:
        compiler.compile(order, max_tokens=need - 1)
    assert e.value.param == "max_tokens"
    any_object = StructuredOutputsParams(json_object=True)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        compiler.compile(any_object, max_tokens=len(compiler.closing_tokens(b"{}")) - 1)
    # What closing cannot follow is not refused: its shortest JSON is not known.
    assert compiler.compile(StructuredOutputsParams(json={"type": "string", "pattern": "a+"}),
                            max_tokens=1)
