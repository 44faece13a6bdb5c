"""The study's decode-speed records: an MLA arm against the GQA conversion with the same KV bytes
per token, decode tokens/s through kvslim's engine (the MLA model decodes with its absorbed
matrices over the latent cache), the models held at once and taking turns in every round
(`bench.latency.models_decode_speed`), at each batch size. Each runs twice: on the engine's
default CPU backend (the C++ paged-attention kernel, which reads the latent row too) and on the
gather backend, so that a gap is not put down to a backend when it is the attention's
arithmetic. Only the conversions are timed: uptraining changes weights, not shapes, so not
speed."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvslim_lab.bench.latency import models_decode_speed
from kvslim.models.config import ModelConfig

PREFIX = "decode-"
# the arms timed: name -> (the study's conversion, engine options)
ARMS = {"mla": ("mla", {}), "gqa": ("align", {}),
        "mla-gather": ("mla", {"attention_backend": "gather"}),
        "gqa-gather": ("align", {"attention_backend": "gather"})}


@dataclass
class DecodeResult:
    name: str                            # decode-k{k}-b{batch}
    kv_heads: float                      # the GQA count whose KV bytes both models have
    batch: int
    models: dict[str, str]               # an arm of ARMS -> the checkpoint directory's name
    kv_bytes_per_token_bf16: dict[str, int]
    tokens_per_s: dict[str, float]       # decode tokens/s, all sequences of the batch together
    input_len: int
    output_len: int
    repeats: int
    seconds: float
    threads: int                         # torch's CPU threads: the speeds depend on them


def is_decode(name: str) -> bool:
    return name.startswith(PREFIX)


def decode_name(k: float, batch: int) -> str:
    return f"{PREFIX}k{k:g}-b{batch}"


def measure_decode(k: float, batch: int, dirs: dict[str, Path], input_len: int,
                   output_len: int, repeats: int) -> DecodeResult:
    """`dirs`: each arm of ARMS' checkpoint."""
    start = time.time()
    speed = models_decode_speed(dirs, input_len, output_len, repeats, batch=batch,
                                options={arm: opts for arm, (_, opts) in ARMS.items()})
    kv_bytes = {arm: ModelConfig.from_dir(d).kv_bytes_per_token("bfloat16")
                for arm, d in dirs.items()}
    return DecodeResult(decode_name(k, batch), k, batch, {a: Path(d).name for a, d in dirs.items()},
                        kv_bytes, speed, input_len, output_len, repeats,
                        round(time.time() - start, 1), torch.get_num_threads())
