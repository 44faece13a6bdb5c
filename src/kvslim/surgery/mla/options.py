"""What `kvslim convert --to-mla` is asked for (`MLAOptions`) and every check of it against the
source model, run before any weight is loaded or written.

Widths, for a source with K KV heads of head_dim d:
- `--rope-dim D`: RoPE dims each query head keeps. mha2mla keeps the same D/2 frequency pairs in
  every KV head, so DeepSeek's shared RoPE key holds K * D dims (D <= d); transmla mixes the KV
  heads per frequency and keeps D/2 mixed pairs in all, so the shared key holds D dims
  (D <= K * d: every pair of every head).
- `--kv-lora-rank R`: the latent of the K/V dims left un-rotated: at most 2 * K * d minus the
  shared RoPE key's width (R at that bound, with every RoPE dim kept, loses nothing)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvslim.errors import KvslimError
from kvslim.layers.rope import FREQUENCY_ONLY_ROPE_TYPES
from kvslim.models.config import ModelConfig
from kvslim.models.families import MLA_FAMILY, MLA_SOURCES

METHODS = ("mha2mla", "transmla")
LATENT_NORMS = ("calibrated", "exact")
ROPE_TYPES = FREQUENCY_ONLY_ROPE_TYPES


@dataclass(frozen=True)
class MLAOptions:
    """method: mha2mla (partial RoPE by query/key norm, SVD of the weights) or transmla (KV
    heads mixed per frequency by PCA, the latent from activation PCA); kv_lora_rank: the
    latent's width; rope_dim: RoPE dims per query head (None: d for transmla, d / 4 for
    mha2mla); latent_norm: how DeepSeek's kv_a_layernorm is made to pass the latent through
    (`calibrated`: weight = the latent's measured RMS; `exact`: the latent scaled far below the
    norm's epsilon, exact to float rounding, its rows uptrained at their own scale by
    train/latent_rows.py)."""
    method: str = "mha2mla"
    kv_lora_rank: int = 0
    rope_dim: int | None = None
    latent_norm: str = "calibrated"
    calib: str | Path | None = None
    calib_samples: int = 32
    calib_seq_len: int = 256

    def rope_dim_for(self, config: ModelConfig) -> int:
        if self.rope_dim is not None:
            return self.rope_dim
        d = config.head_dim
        return d if self.method == "transmla" else max(2, d // 4 // 2 * 2)


def rope_key_width(config: ModelConfig, method: str, rope_dim: int) -> int:
    """Width of DeepSeek's shared RoPE key (qk_rope_head_dim) for `rope_dim` per query head."""
    return rope_dim * config.num_key_value_heads if method == "mha2mla" else rope_dim


def max_rank(config: ModelConfig, rope_width: int) -> int:
    """The K/V dims left without RoPE: the most a latent can hold without loss."""
    return 2 * config.num_key_value_heads * config.head_dim - rope_width


def check_source(config: ModelConfig) -> None:
    """Llama-family dense attention only, each refusal saying why."""
    arch = config.architecture
    if arch not in {f.architecture for f in MLA_SOURCES}:
        why = (f" (its query bias has no place in {MLA_FAMILY.name}'s q_proj)"
               if config.qkv_bias else "")
        raise KvslimError(f"--to-mla converts {', '.join(f.architecture for f in MLA_SOURCES)}; "
                          f"{arch} is not supported{why}")
    for flaw, why in ((config.qkv_bias or config.o_bias, "attention biases"),
                      (config.qk_norm, "q/k norms"),
                      (config.sliding_window is not None, "a sliding window"),
                      (config.layer_kv_heads is not None, "per-layer KV heads"),
                      (config.quantization is not None, "quantized weights")):
        if flaw:
            raise KvslimError(f"--to-mla cannot convert {config.name or arch}: {why} have no "
                              f"{MLA_FAMILY.name} equivalent here")
    rope_type = (config.rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise KvslimError(f"--to-mla cannot convert {rope_type} RoPE scaling (supported: "
                          f"{', '.join(ROPE_TYPES)})")


def check_options(config: ModelConfig, options: MLAOptions) -> None:
    """Every refusal of `options` for this source, one line each."""
    check_source(config)
    if options.method not in METHODS:
        raise KvslimError(f"unknown --method {options.method!r} for --to-mla; choose one of "
                          f"{', '.join(METHODS)}")
    if options.latent_norm not in LATENT_NORMS:
        raise KvslimError(f"unknown --latent-norm {options.latent_norm!r}; choose one of "
                          f"{', '.join(LATENT_NORMS)}")
    d, kv = config.head_dim, config.num_key_value_heads
    rope_dim = options.rope_dim_for(config)
    bound = d if options.method == "mha2mla" else kv * d
    where = ("head_dim" if options.method == "mha2mla" else
             f"the {kv} KV heads' {kv} x {d} RoPE dims")
    if not isinstance(rope_dim, int) or rope_dim <= 0 or rope_dim % 2 or rope_dim > bound:
        raise KvslimError(f"--rope-dim {rope_dim} must be even and in 2..{bound} "
                          f"({where}) for --method {options.method}")
    rank, limit = options.kv_lora_rank, max_rank(config, rope_key_width(config, options.method,
                                                                        rope_dim))
    if not isinstance(rank, int) or rank <= 0 or rank > limit:
        raise KvslimError(f"--kv-lora-rank {rank} must be in 1..{limit} (the source's K/V width "
                          f"2 x {kv} x {d} less {2 * kv * d - limit} RoPE dims)")
    if options.method == "transmla" and options.calib is None:
        raise KvslimError("--method transmla needs calibration text: --calib FILE")
    if options.calib is not None and not Path(options.calib).is_file():
        raise KvslimError(f"--calib {options.calib}: no such file")
    if options.latent_norm == "exact" and config.torch_dtype == "float16":
        raise KvslimError("--latent-norm exact scales the latent below float16's range; "
                          "convert a float32 or bfloat16 model")


def mla_row(config: ModelConfig, k: float) -> int:
    """Cached elements per token and layer of GQA with k KV heads: the row an MLA model at
    GQA-k's KV bytes gets."""
    return round(k * config.kv_elements_per_token(1) / config.num_hidden_layers)


def mla_widths(config: ModelConfig, k: float, method: str, rope_fraction: float
               ) -> tuple[int, int]:
    """(`--rope-dim`, `--kv-lora-rank`) for `method` (transmla or mha2mla) at GQA-k's bytes.
    mha2mla's rope dim is per KV head (its shared key holds one per head), transmla's is the
    shared key's width; both even, at least 2."""
    row = mla_row(config, k)
    per = config.num_key_value_heads if method == "mha2mla" else 1
    rope_dim = max(2, round(row * rope_fraction / per / 2) * 2)
    return rope_dim, row - rope_key_width(config, method, rope_dim)
