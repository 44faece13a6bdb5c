"""Train a byte-level BPE tokenizer (GPT-2 style) with the `tokenizers` library and write the
files HF `transformers` (PreTrainedTokenizerFast) and kvslim both load."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvslim.errors import KvslimError

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
# ChatML, the template SmolLM2 and Qwen2 use, so chat works the same on trained models.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def train_tokenizer(data_files: list[str | Path], vocab_size: int, out_dir: str | Path,
                    min_frequency: int = 2, show_progress: bool = True) -> Tokenizer:
    for f in data_files:
        if not Path(f).is_file():
            raise KvslimError(f"data file not found: {f}")
        if Path(f).stat().st_size == 0:
            raise KvslimError(f"data file is empty: {f}")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise KvslimError(f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)} "
                          f"(256 bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    tok.train([str(f) for f in data_files], trainer)
    write_tokenizer_files(tok, out_dir)
    return tok


def write_tokenizer_files(tok: Tokenizer, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
