"""Text that is not valid Unicode gets kvslim's one-line error, not tokenizers' TypeError."""
import pytest

from checkpoints import write_tokenizer
from kvslim.errors import KvslimError
from kvslim.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return Tokenizer.from_dir(path)


@pytest.mark.parametrize("text", ["Hi \ud800 there", "\udc00", "ok \ud83d"])
def test_a_lone_surrogate_is_named(tok, text):
    with pytest.raises(KvslimError, match="lone UTF-16 surrogate"):
        tok.encode(text)


def test_a_paired_surrogate_is_a_character(tok):
    assert tok.encode("\ud83d\ude00".encode("utf-16", "surrogatepass").decode("utf-16")) \
        == tok.encode("😀")
