"""SchemaCloser: for every prefix of every valid instance, the prefix plus its closing parses,
validates against the schema and is accepted by llguidance's grammar, and writing the closing
leaves exactly the rest of it; one token never adds more to the closing's cost than growth_bound
says, and writing it takes no more tokens than its cost (the invariants the manager's budget
rests on); a number begun is brought into its range; whatever bytes come, the closer answers."""
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslim.structured.grammar import GrammarCompiler
from kvslim.structured.params import StructuredOutputsParams
from kvslim.structured.schema_closer import SchemaCloser, complete_number, probes_of
from kvslim.structured.schema_shape import NumberAlt, SchemaShape
from kvslim.tokenizer.tokenizer import Tokenizer
from structured.schema_instances import SCHEMAS, instances

# As the grammar lets a model write JSON: characters unescaped (it allows "\u" only for
# control characters).
STYLES = st.sampled_from([dict(separators=(",", ":")), dict(), dict(indent=2), dict(indent=1)])


@pytest.fixture(scope="module")
def compiler(hf_checkpoints):
    return GrammarCompiler(Tokenizer.from_dir(hf_checkpoints["gqa"]), 320, [0])


def closer_after(shape: SchemaShape, text: bytes) -> SchemaCloser:
    closer = SchemaCloser(shape)
    closer.feed(text)
    return closer


def accepted(compiler, grammar: str, text: bytes) -> bool:
    matcher = compiler.matcher(grammar)
    tokens = compiler.ll_tokenizer.tokenize_bytes(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_prefix_plus_its_closing_is_valid(compiler, name):
    schema = SCHEMAS[name]
    shape = SchemaShape(schema)
    grammar = compiler.compile(StructuredOutputsParams(json=schema))

    @settings(max_examples=15, deadline=None)
    @given(instances(schema), STYLES)
    def check(instance, style):
        text = json.dumps(instance, ensure_ascii=False, **style).encode()
        closer = SchemaCloser(shape)
        for i in range(len(text) + 1):
            closer.feed(text[i - 1:i] if i else b"")
            closing = closer.closing()
            assert not closer.lost, text[:i]
            whole = text[:i] + closing
            jsonschema.validate(json.loads(whole), schema)
            twin = closer.copy()
            for k in range(len(closing)):                 # its own bytes leave the rest
                twin.feed(closing[k:k + 1])
                assert twin.closing() == closing[k + 1:], (text[:i], closing)
            if i % 7 == 0 or i == len(text):              # llguidance: slower, so every 7th
                assert accepted(compiler, grammar, whole), whole
        assert closer.closing() == b""
    check()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_no_token_grows_a_closing_by_more_than_growth_bound(compiler, name):
    schema = SCHEMAS[name]
    tokens_of = compiler.closing_tokens

    @settings(max_examples=25, deadline=None)
    @given(instances(schema), STYLES, st.data())
    def check(instance, style, data):
        text = json.dumps(instance, ensure_ascii=False, **style).encode()
        cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=60)))
        tokens = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)]) if a < b]
        probes = probes_of(tokens)                       # the tokens are the vocabulary
        closer = SchemaCloser(SchemaShape(schema), depth=1 + max(
            t.count(b"}") + t.count(b"]") for t in tokens))
        for token in tokens:
            before, bound = closer.cost(tokens_of), closer.growth_bound(probes, tokens_of)
            assert len(closer.closing_tokens(tokens_of)) <= before
            closer.feed(token)
            assert closer.cost(tokens_of) - before <= bound, (token, bound)
    check()


def test_another_property_never_takes_a_declared_name(compiler):
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}}
    grammar = compiler.compile(StructuredOutputsParams(json=schema))
    for prefix, closing in [(b'{"', b'":null}'), (b'{"b":true,"', b'":null}'),
                            (b'{"b":true,"b', b'_":null}'), (b'{"b":true,', b'"":null}')]:
        assert closer_after(SchemaShape(schema), prefix).closing() == closing, prefix
        assert accepted(compiler, grammar, prefix + closing), prefix


def test_the_shortest_documents(compiler):
    assert SchemaShape(SCHEMAS["order"]).root.min == \
        b'{"id":1000,"items":[{"sku":"aa","qty":1}],"price":1}'
    assert SchemaShape(SCHEMAS["grid"]).root.min == \
        b'{"grid":[[-2,-2]],"label":"","kind":"grid"}'
    assert SchemaShape(SCHEMAS["tree"]).root.min == b'{"name":""}'


@pytest.mark.parametrize("text, bounds, closing", [
    (b"1", dict(low=1000, high=2100), b"000"), (b"2", dict(low=1000, high=2100), b"000"),
    (b"21", dict(low=1000, high=2100), b"00"), (b"-", dict(low=-9, high=-5), b"5"),
    (b"-", dict(low=None, high=None), b"0"), (b"0", dict(low=None, high=None), b""),
    (b"1.", dict(low=None, high=None), b"0"), (b"1e", dict(low=None, high=None), b"0"),
    (b"3", dict(low=25, high=40), b"0"), (b"12", dict(low=None, high=5), None),
])
def test_an_integer_begun_is_brought_into_its_range(text, bounds, closing):
    assert complete_number(text, NumberAlt(True, **bounds)) == closing


@pytest.mark.parametrize("text, bounds, closing", [
    (b"0", dict(low=0.5, high=99.5), b".5"), (b"0.", dict(low=0.5, high=99.5), b"5"),
    (b"99.", dict(low=0.5, high=99.5), b"0"), (b"0.4", dict(low=0.5, high=99.5), None),
    (b"0", dict(low=0, high=1, low_open=True, high_open=True), b".1"),
    (b"-0", dict(low=-1.5, high=-0.25), b".3"), (b"-", dict(low=-1.5, high=-0.25), b"1"),
    (b"2.5e", dict(low=None, high=None), b"0"),
])
def test_a_fraction_begun_is_brought_into_its_range(text, bounds, closing):
    assert complete_number(text, NumberAlt(False, **bounds)) == closing


JUNK = st.sampled_from(
    [b"{", b"}", b"[", b"]", b'"', b",", b":", b"-", b".", b"e", b"+", b"0", b"7", b" ", b"\\",
     b"u", b"n", b"t", b"a", b"sku", b"qty", b"id", b"\xc3", b"\xa9", b'":', b'"}', b'":[{"',
     b"null", b"1.2.", b"0.", b"-.", b"1e+", b"00"])


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_any_bytes_leave_a_closing_or_none_never_an_error(name):
    """The closer runs beside the forward pass: after a valid start, whatever bytes come (a
    grammar would forbid most of these), it answers."""
    schema = SCHEMAS[name]
    shape = SchemaShape(schema)

    @settings(max_examples=40, deadline=None)
    @given(instances(schema), st.lists(st.lists(JUNK, max_size=3).map(b"".join), max_size=8))
    def check(instance, junk):
        text = json.dumps(instance, ensure_ascii=False).encode()
        for i in range(len(text) + 1):
            closer = closer_after(shape, text[:i])
            closer.growth_bound(junk, tuple)              # feeds each junk token to a copy
            for token in junk:
                closer.feed(token)
                closer.closing()
                assert closer.error is None, (text[:i], junk)
    check()
