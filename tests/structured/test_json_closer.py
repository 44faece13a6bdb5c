"""JsonCloser: for every prefix of every JSON object, the prefix plus its closing text parses;
one token never lengthens a closing by more than max_growth says (the invariant the manager's
budget rests on); bytes no JSON allows are reported, not guessed at."""
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvslim.structured.json_closer import JsonCloser, max_growth, utf8_tail

SCALARS = st.none() | st.booleans() | st.integers(-10**12, 10**12) \
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=12)
OBJECTS = st.dictionaries(st.text(max_size=4), VALUES, max_size=4)
STYLES = st.sampled_from([dict(separators=(",", ":")), dict(), dict(indent=2),
                          dict(ensure_ascii=False), dict(ensure_ascii=False, indent=1)])


def closed(prefix: bytes) -> bytes:
    closer = JsonCloser()
    closer.feed(prefix)
    return prefix + closer.closing()


@settings(max_examples=60, deadline=None)
@given(OBJECTS, STYLES)
def test_every_prefix_plus_its_closing_parses(obj, style):
    text = json.dumps(obj, **style).encode()
    for i in range(len(text) + 1):
        assert isinstance(json.loads(closed(text[:i])), dict), text[:i]
    closer = JsonCloser()
    closer.feed(text)
    assert closer.closing() == b""                       # a whole object needs nothing


@settings(max_examples=60, deadline=None)
@given(OBJECTS, STYLES, st.data())
def test_no_token_grows_a_closing_by_more_than_max_growth(obj, style, data):
    text = json.dumps(obj, **style).encode()
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=40)))
    tokens = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)]) if a < b]
    bound = max_growth(tokens)
    closer = JsonCloser()
    before = len(closer.closing())
    for token in tokens:
        closer.feed(token)
        after = len(closer.closing())
        assert after - before <= bound, (token, after - before, bound)
        before = after


def test_closing_texts_of_each_kind_of_state():
    cases = {b"": b"{}", b"{": b"}", b'{"a": [1, {"b"': b':null}]}', b'{"a":"x\\': b'n"}',
             b'{"a":"\\u1': b'000"}', b'{"a":-': b"0}", b'{"a":1e+': b"0}", b'{"a":tr': b"ue}",
             b'{"a":[': b"]}", b'{"a":[1,': b"null]}", b'{"a":1,': b'"":null}',
             '{"a":"é'.encode()[:-1]: b'\x80"}'}
    for prefix, closing in cases.items():
        closer = JsonCloser()
        closer.feed(prefix)
        assert closer.closing() == closing, prefix


def test_bytes_no_json_allows_leave_nothing_to_close():
    for text in [b'{"a":1}x', b"{]", b'{"a" 1', b'{"a":nul!', b'{"a":"\\uZ']:
        closer = JsonCloser()
        closer.feed(text)
        assert closer.broken and closer.closing() is None, text


def test_utf8_tails_complete_every_lead_byte():
    for lead in range(0xC2, 0xF5):
        char = bytes([lead]) + utf8_tail(lead)
        char.decode("utf-8")                              # raises if the tail were wrong


def test_a_token_that_goes_on_inside_a_literal_is_bounded():
    """Found by the property above: a token that finishes a `null` begun by the last one, closes
    the array and asks for another member grows the closing by 5 (`l]}` -> `"":null}`)."""
    token = b"l,\n   null\n  ],"
    closer = JsonCloser()
    closer.feed(b'{"a": [false, nul')
    before = len(closer.closing())
    closer.feed(token)
    assert len(closer.closing()) - before <= max_growth([token])
