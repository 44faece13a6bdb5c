"""Rebuild `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` from the
vocabulary a GGUF file carries in its metadata (`tokenizer.ggml.*`).

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, Qwen2) are
assembled here the way transformers assembles one for the same file (GPT-2 style BPE, ByteLevel
pre-tokenizer and decoder, no normalizer, control tokens added whole as special tokens), so that
both turn the same text into the same ids; tests/model check this on real text. SentencePiece
vocabularies ("llama": Llama 2, Mistral, TinyLlama) take transformers' own builder for GGUF
files — merges recovered from the scores, byte fallback, "▁" for spaces — and the BOS rule of
llama.cpp."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from kvslim.errors import ConfigError
from kvslim.formats.gguf.file import GGUFFile

# llama.cpp's token types (gguf.TokenType): which tokens must never be split by BPE.
CONTROL, USER_DEFINED = 3, 4

# Vocabularies trained with Llama 3's split regex, by their `tokenizer.ggml.pre` name. Any other
# name gets GPT-2's built-in ByteLevel split, which is also what transformers falls back to.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PATTERNS = {name: LLAMA3_SPLIT for name in
                  ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral", "dbrx")}

SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def tokenizer_files(gguf: GGUFFile) -> dict[str, str]:
    """File name -> text of the three tokenizer files for this GGUF's vocabulary."""
    kind = gguf.get("tokenizer.ggml.model")
    if kind is None:
        raise ConfigError(f"{gguf.path.name}: GGUF has no tokenizer (no tokenizer.ggml.model)")
    if kind not in ("gpt2", "llama"):
        raise ConfigError(f"{gguf.path.name}: GGUF tokenizer model {kind!r} is not supported; "
                          "kvslim rebuilds byte-level BPE ('gpt2') and SentencePiece ('llama') "
                          "vocabularies")
    tokens = list(gguf.require("tokenizer.ggml.tokens"))
    specials = _special_tokens(gguf, tokens)
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False))
    tok = build_tokenizer(gguf, tokens) if kind == "gpt2" else sentencepiece_tokenizer(gguf)
    tok.post_processor = _post_processor(tokens, gguf, add_bos, add_eos)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        **specials,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.get(f"{gguf.architecture}.context_length", 2048)),
    }
    template = gguf.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    generation = {name.replace("_token", "_token_id"): gguf.get(key)
                  for name, key in SPECIAL_TOKEN_KEYS.items()
                  if name != "unk_token" and gguf.get(key) is not None}
    return {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }


def write_tokenizer_files(files: dict[str, str], out_dir: str | Path) -> None:
    for name, text in files.items():
        (Path(out_dir) / name).write_text(text, encoding="utf-8")


def build_tokenizer(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # GGUF may store a token as raw text; BPE needs it in the byte alphabet (" " -> "Ġ").
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    split = SPLIT_PATTERNS.get(gguf.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _add_whole_tokens(tok, tokens, gguf.get("tokenizer.ggml.token_type") or [], alphabet, vocab)
    return tok


def sentencepiece_tokenizer(gguf: GGUFFile) -> Tokenizer:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (convert_gguf_tokenizer,
                                                                       get_gguf_tokenizer)
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(gguf.path))
    tok, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return tok


def _add_whole_tokens(tok: Tokenizer, tokens: list[str], types: list[int], alphabet: set[str],
                      vocab: dict[str, int]) -> None:
    """Control tokens become special tokens and user-defined ones plain added tokens, so that
    both are matched whole in text instead of being cut into byte pieces. A "control" token
    spelled outside the byte alphabet is a llama.cpp mislabel, skipped (as transformers does)."""
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _special_tokens(gguf: GGUFFile, tokens: list[str]) -> dict[str, str | None]:
    result = {}
    for name, key in SPECIAL_TOKEN_KEYS.items():
        token_id = gguf.get(key)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ConfigError(f"{gguf.path.name}: {key} = {token_id} is outside the vocabulary "
                              f"of {len(tokens)} tokens")
        result[name] = None if token_id is None else tokens[token_id]
    return result


def _post_processor(tokens: list[str], gguf: GGUFFile, add_bos: bool, add_eos: bool
                    ) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence exactly when the GGUF asks llama.cpp to add them."""
    bos_id = gguf.get(SPECIAL_TOKEN_KEYS["bos_token"])
    eos_id = gguf.get(SPECIAL_TOKEN_KEYS["eos_token"])
    add_bos, add_eos = add_bos and bos_id is not None, add_eos and eos_id is not None
    specials = ([(tokens[bos_id], bos_id)] if add_bos else []) + \
               ([(tokens[eos_id], eos_id)] if add_eos else [])

    def sequence(name: str, type_id: int) -> list[str]:
        return ([f"{tokens[bos_id]}:{type_id}"] if add_bos else []) + [f"${name}:{type_id}"] + \
               ([f"{tokens[eos_id]}:{type_id}"] if add_eos else [])

    return processors.TemplateProcessing(single=sequence("A", 0),
                                         pair=sequence("A", 0) + sequence("B", 1),
                                         special_tokens=specials)


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return dict(sorted(mapping.items()))
