"""Incremental detokenization: whole characters only, stop strings cut exactly."""
import pytest

from checkpoints import write_tokenizer
from kvslim.engine.detokenizer import IncrementalDetokenizer
from kvslim.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return Tokenizer.from_dir(path)


def stream(tok, text, stop=(), include=False, prompt="In the beginning"):
    d = IncrementalDetokenizer(tok, tok.encode(prompt), list(stop), True, include)
    deltas = []
    for t in tok.encode(text):
        d.add_tokens([t])
        deltas.append(d.take_delta(finished=d.stopped_by is not None))
        if d.stopped_by:
            break
    deltas.append(d.take_delta(finished=True))
    return d, deltas


def test_multibyte_characters_are_never_split(tok):
    text = " 日本 ✓ é ü and 日本"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())                 # some characters span several tokens
    d, deltas = stream(tok, text)
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == text == d.text


def test_stop_string_cuts_exactly_before_it(tok):
    d, deltas = stream(tok, " the heaven and the earth", stop=["and"])
    assert d.stopped_by == "and"
    assert d.text == "".join(deltas) == " the heaven "


def test_stop_string_can_be_kept(tok):
    d, _ = stream(tok, " the heaven and the earth", stop=["and"], include=True)
    assert d.text == " the heaven and"


def test_earliest_of_several_stop_strings_wins(tok):
    d, _ = stream(tok, " a single man in possession", stop=["possession", "man in"])
    assert d.stopped_by == "man in" and d.text == " a single "


def test_streaming_holds_back_a_possible_stop_prefix(tok):
    d = IncrementalDetokenizer(tok, [], ["earth!"], True, False)
    d.add_tokens(tok.encode(" the earth"))
    assert d.take_delta(False) == " the "                # "earth" might become "earth!"
    d.add_tokens(tok.encode("."))
    assert d.take_delta(False) == "e"                    # 5 characters are always held back
    assert d.take_delta(True) == "arth."


def test_no_stop_before_min_tokens(tok):
    d = IncrementalDetokenizer(tok, [], ["the"], True, False)
    d.add_tokens(tok.encode(" the"), check_stop=False)
    assert d.stopped_by is None
    d.add_tokens(tok.encode(" heaven the"), check_stop=True)
    assert d.stopped_by == "the" and d.text == " the heaven "
