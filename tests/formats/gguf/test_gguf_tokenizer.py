"""The tokenizer rebuilt from GGUF metadata against transformers' tokenizer for the same file."""
import json

import pytest
from tokenizers import pre_tokenizers

from gguf_files import SPECIALS, write_tiny_gguf
from kvslim.errors import ConfigError
from kvslim.formats.gguf.file import GGUFFile
from kvslim.formats.gguf.importer import import_gguf
from kvslim.formats.gguf.tokenizer import byte_alphabet, tokenizer_files
from kvslim.tokenizer.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def valid_lines(shared_dir):
    text = (shared_dir / "corpus" / "valid.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()][:1000]


def test_encodes_corpus_like_transformers(smollm2_dir, reference, valid_lines):
    tok = Tokenizer.from_dir(smollm2_dir)
    assert len(valid_lines) == 1000
    ours = [tok.encode(line) for line in valid_lines]
    assert ours == reference(valid_lines)["input_ids"]
    assert [tok.decode(ids) for ids in ours] == valid_lines


def test_special_tokens_and_chat_template(smollm2_dir, reference):
    tok = Tokenizer.from_dir(smollm2_dir)
    assert tok.vocab_size == 49152
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text) == reference(text)["input_ids"] == [1, 4093, 198, 6004, 2]
    assert tok.token_str("bos_token") == "<|im_start|>"
    assert tok.eos_token_ids == [2]
    prompt = tok.apply_chat_template(CHAT)
    assert prompt == reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False
    assert (config["eos_token"], config["pad_token"], config["unk_token"]) == \
        ("<|im_end|>", "<|im_end|>", "<|endoftext|>")


def test_transformers_reads_the_imported_directory(smollm2_dir, reference, valid_lines):
    from transformers import AutoTokenizer
    loaded = AutoTokenizer.from_pretrained(smollm2_dir)
    lines = valid_lines[:100]
    assert loaded(lines)["input_ids"] == reference(lines)["input_ids"]
    assert loaded.eos_token == "<|im_end|>"


def test_byte_alphabet_is_gpt2s():
    alphabet = byte_alphabet()
    assert len(set(alphabet.values())) == 256
    assert set(alphabet.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert (alphabet[ord(" ")], alphabet[ord("\n")], alphabet[ord("A")]) == ("Ġ", "Ċ", "A")


@pytest.mark.parametrize("add_bos", [False, True])
def test_add_bos_token_follows_gguf(tmp_path, add_bos):
    write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=add_bos)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False)
    tok = Tokenizer.from_dir(out)
    hello = tok.tok.token_to_id("hello")
    assert tok.encode("hello") == ([1] if add_bos else []) + [hello]
    assert tok.encode("hello", add_special_tokens=False) == [hello]
    assert tok.encode("<|im_end|>hello", add_special_tokens=False) == [2, hello]
    assert tok.decode(tok.encode(" hello world")) == " hello world"
    assert [tok.id_to_token(i) for i in range(3)] == SPECIALS


SPM_TEXTS = ["hello world", " hello  world", "the world and hello", "Hello, wörld! 日本",
             "in\nan\n\nworld", "", "  ", "hello</s><s>"]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A SentencePiece GGUF (llama.cpp "llama" vocabulary, no add_bos flag: llama.cpp adds BOS),
    imported by kvslim, and transformers' tokenizer for the same file."""
    from transformers import AutoTokenizer
    tmp = tmp_path_factory.mktemp("spm")
    write_tiny_gguf(tmp / "spm.gguf", vocab="llama", add_bos=None)
    out = import_gguf(tmp / "spm.gguf", tmp / "out", show_progress=False)
    return out, AutoTokenizer.from_pretrained(tmp, gguf_file="spm.gguf")


def test_sentencepiece_vocabulary_encodes_like_transformers(spm):
    out, reference = spm
    tok = Tokenizer.from_dir(out)
    for text in SPM_TEXTS:
        assert tok.encode(text) == reference(text)["input_ids"], text
    ids = tok.encode("hello world")
    assert ids[0] == 1                                   # BOS, as llama.cpp adds it
    assert [tok.id_to_token(i) for i in ids[1:]] == ["\u2581hello", "\u2581world"]
    assert tok.encode("日", add_special_tokens=False)[-3:] == [3 + b for b in "日".encode()]
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    for text in ("hello world", "the world and hello", "Hello, wörld! 日本", "in\nan\n\nworld"):
        assert tok.decode(tok.encode(text)) == text
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == \
        ("<s>", "</s>", "<unk>")
    assert config["add_bos_token"] is True


def test_other_tokenizer_models_are_refused(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    gguf = GGUFFile.open(tmp_path / "tiny.gguf")
    real_get = gguf.get
    monkeypatch.setattr(gguf, "get", lambda key, default=None: "bert"
                        if key == "tokenizer.ggml.model" else real_get(key, default))
    with pytest.raises(ConfigError, match="tokenizer model 'bert' is not supported"):
        tokenizer_files(gguf)
