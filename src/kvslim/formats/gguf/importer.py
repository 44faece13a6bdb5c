"""Import a GGUF file (an architecture some family's layout in models/ describes: archs.py's
SUPPORTED_GGUF_ARCHITECTURES) as an HF-format model directory (float32 weights, config.json, a
rebuilt tokenizer) that kvslim and transformers both load.

Everything is read and checked before anything is written, so a file kvslim cannot use leaves no
output behind."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from kvslim.errors import ConfigError
from kvslim.models.config import ModelConfig
from kvslim.formats.gguf.archs import LAYER_TENSORS, SUPPORTED_GGUF_ARCHITECTURES, gguf_family
from kvslim.formats.gguf.blocks import TYPE_IDS, kept_type
from kvslim.formats.gguf.file import GGUFFile, dequantize_tensor
from kvslim.formats.gguf.moe import legacy_expert_name, moe_config_fields, split_experts
from kvslim.formats.gguf.rope import llama3_scaling_from_divisors
from kvslim.formats.gguf.tokenizer import tokenizer_files, write_tokenizer_files
from kvslim.quantization.gguf_blocks import gguf_spec
from kvslim.formats.writer import save_model
from kvslim.models.families import family_of

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
FLOAT_TYPES = ("F32", "F16", "BF16")
# tensors that are config, not weights (Llama 3.1's RoPE divisors, read into rope_scaling)
DERIVED_TENSORS = ("rope_freqs.weight",)
LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, show_progress: bool = True,
                keep_quantized: bool = False, require_quantized: bool = False) -> Path:
    """keep_quantized: when every decoder linear is of a type kvslim keeps quantized (Q4_0, Q4_1,
    Q5_0, Q8_0, Q4_K, Q6_K, any mix: `TYPE_IDS`), write config.json and the tokenizer beside
    the GGUF file itself (hard-linked, else copied) instead of float weights; the loader then
    reads those linears, and the token embeddings and LM head when they are of such a type too,
    as blocks (formats/gguf/weights.py). A linear of another type makes it a float32 import,
    with a note on stderr, or, with require_quantized, an error naming the tensor and its
    type."""
    gguf = GGUFFile.open(gguf_path)
    config = config_from_gguf(gguf)
    tok_files = tokenizer_files(gguf)
    names = {t.name: hf_tensor_name(t.name, gguf.architecture) for t in gguf.tensors
             if t.name not in DERIVED_TENSORS}
    family = family_of(config)
    # MoE experts run as float layers: no block-kept expert kernels yet
    if family.gguf.float_only or config.moe is not None:
        if require_quantized:
            what = "MoE" if config.moe is not None else gguf.architecture
            raise ConfigError(f"{gguf.path.name}: kvslim imports {what} GGUF files as float32 "
                              "only (--dtype float32)")
        keep_quantized = False
    other = first_unkept_linear(gguf) if keep_quantized or require_quantized else None
    if other is not None and require_quantized:
        raise ConfigError(f"{gguf.path.name}: tensor {other[0]!r} is {other[1]}, which kvslim "
                          f"does not keep quantized (kept: {', '.join(TYPE_IDS)})")
    if other is not None and other[1] not in FLOAT_TYPES:      # a float file needs no note
        print(f"note: {gguf.path.name}: tensor {other[0]!r} is {other[1]}, which kvslim does not "
              "keep quantized; importing every weight as float32", file=sys.stderr)
    if (keep_quantized or require_quantized) and other is None and _has_linears(gguf):
        out = _write_gguf_backed(gguf, config, Path(out_dir))
    else:
        state = {}
        for tensor in tqdm([t for t in gguf.tensors if t.name in names],
                           desc=f"importing {gguf.path.name}", unit="tensor",
                           disable=not show_progress):
            weight = from_gguf(tensor.name, dequantize_tensor(tensor), config)
            # an MoE layer's stacked experts one by one; a family's checkpoint names (Phi-3's
            # fused projections) as kvslim's
            for name, part in split_experts(names[tensor.name], weight):
                state.update(family.from_checkpoint(name, part, config))
        out = save_model(state, config, out_dir, dtype=torch.float32)
    write_tokenizer_files(tok_files, out)
    return out


def from_gguf(gguf_name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A dequantized tensor in the layout transformers holds it in."""
    layout = family_of(config).gguf
    if layout.norms_plus_one:
        return weight - 1.0 if gguf_name.endswith("norm.weight") else weight
    if layout.permutes_qk:
        return unpermute_qk(gguf_name, weight, config)
    return weight


def gguf_arch(config: ModelConfig) -> str:
    """The GGUF architecture a config was imported from."""
    return family_of(config).gguf.arch


def is_linear(gguf_name: str) -> bool:
    """A decoder layer's linear weight (the LM head and embeddings are not)."""
    m = _LAYER_NAME.fullmatch(gguf_name)
    return m is not None and m.group(2) in LINEAR_PARTS and m.group(3) == "weight"


def _has_linears(gguf: GGUFFile) -> bool:
    return any(is_linear(t.name) for t in gguf.tensors)


def first_unkept_linear(gguf: GGUFFile) -> tuple[str, str] | None:
    """(name, type) of the first decoder linear kvslim cannot keep quantized (F32/F16 count:
    the block layers hold quantized values only)."""
    for t in gguf.tensors:
        if is_linear(t.name) and not kept_type(t.tensor_type.name, int(t.shape[0])):
            return t.name, t.tensor_type.name
    return None


def _kept(gguf: GGUFFile, name: str) -> bool:
    return any(t.name == name and kept_type(t.tensor_type.name, int(t.shape[0]))
               for t in gguf.tensors)


def _write_gguf_backed(gguf: GGUFFile, config: ModelConfig, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    target = out / gguf.path.name
    target.unlink(missing_ok=True)
    try:
        os.link(gguf.path, target)
    except OSError:
        shutil.copyfile(gguf.path, target)
    cfg = config.replace(torch_dtype="float32").to_hf_dict()
    cfg["quantization_config"] = gguf_spec({
        "file": target.name, "embedding": _kept(gguf, "token_embd.weight"),
        "lm_head": _kept(gguf, "output.weight")}).to_hf()
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


# ---- config ------------------------------------------------------------------------------
def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ConfigError(f"{gguf.path.name}: GGUF architecture {arch!r} is not supported; "
                          f"kvslim imports {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} GGUF files")

    def key(name: str):
        return gguf.require(f"{arch}.{name}")

    def optional(name: str, default):
        return gguf.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = gguf.get(f"{arch}.attention.head_count_kv", heads)
    layer_kv_heads = tuple(int(k) for k in kv_heads) if isinstance(kv_heads, list) else None
    head_dim = int(optional("attention.key_length", hidden // max(heads, 1)))
    _check_head_dims(gguf, arch, head_dim)
    names = gguf.tensor_names
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    vocab = optional("vocab_size", None) or len(tokens) or _embedding_rows(gguf)
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    family = _family_fields(gguf, arch, key, optional, head_dim)
    return ModelConfig(**{**dict(
        architecture="LlamaForCausalLM",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=max(layer_kv_heads) if layer_kv_heads else int(kv_heads),
        layer_kv_heads=layer_kv_heads,          # llama.cpp's per-layer array, if any
        head_dim=head_dim,
        rms_norm_eps=float(optional("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(optional("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gguf, arch),
        max_position_embeddings=int(optional("context_length", 2048)),
        # llama.cpp writes no `output` tensor when the LM head is the embedding matrix.
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    ), **family})


def _family_fields(gguf: GGUFFile, arch: str, key, optional, head_dim: int) -> dict:
    """The fields the file's family sets: its architecture (with experts or not), and what its
    layout reads (models/<family>.py)."""
    experts = moe_config_fields(gguf, arch)
    family = gguf_family(arch, experts=bool(experts))
    fields = {"architecture": family.architecture, **experts}
    if family.gguf.sliding_window:
        fields["sliding_window"] = optional("attention.sliding_window", None)
    if family.gguf.fields is not None:
        fields.update(family.gguf.fields(key, optional, head_dim))
    return fields


def _check_head_dims(gguf: GGUFFile, arch: str, head_dim: int) -> None:
    value_dim = gguf.get(f"{arch}.attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise ConfigError(f"{gguf.path.name}: key length {head_dim} != value length {value_dim}; "
                          "kvslim needs equal K and V head sizes")
    rope_dim = gguf.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ConfigError(f"{gguf.path.name}: RoPE covers {rope_dim} of {head_dim} head dimensions; "
                          "partial rotary embeddings are not supported")


def _rope_scaling(gguf: GGUFFile, arch: str) -> dict | None:
    if "rope_factors_long.weight" in gguf.tensor_names:
        raise ConfigError(f"{gguf.path.name}: longrope factors (Phi-3 128k) are not supported: "
                          "they switch with the sequence's length")
    if "rope_freqs.weight" in gguf.tensor_names:
        # Llama 3.1-style files carry per-frequency divisors instead of the rope_scaling
        # parameters they were computed from; the plain frequencies would be silently wrong.
        tensor = next(t for t in gguf.tensors if t.name == "rope_freqs.weight")
        head_dim = int(gguf.get(f"{arch}.attention.key_length") or
                       int(gguf.require(f"{arch}.embedding_length"))
                       // int(gguf.require(f"{arch}.attention.head_count")))
        scaling = llama3_scaling_from_divisors(dequantize_tensor(tensor).flatten(), head_dim,
                                               float(gguf.get(f"{arch}.rope.freq_base", 10000.0)))
        if scaling is None:
            raise ConfigError(f"{gguf.path.name}: per-frequency RoPE factors (rope_freqs) that "
                              "no Llama 3 rope scaling reproduces are not supported")
        return scaling
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf.require(f"{arch}.rope.scaling.factor"))}
    raise ConfigError(f"{gguf.path.name}: RoPE scaling {kind!r} is not supported "
                      "(supported: none, linear)")


def _embedding_rows(gguf: GGUFFile) -> int:
    for t in gguf.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])
    raise ConfigError(f"{gguf.path.name}: no token_embd.weight tensor")


# ---- tensors -----------------------------------------------------------------------------
def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    layer_tensors = LAYER_TENSORS[arch]
    if m := _LAYER_NAME.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in layer_tensors:
            return f"model.layers.{layer}.{layer_tensors[part]}.{kind}"
    elif (m := _GLOBAL_NAME.fullmatch(gguf_name)) and m.group(1) in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    elif "ffn_gate_exps" in layer_tensors and (name := legacy_expert_name(gguf_name)):
        return name
    raise ConfigError(f"unexpected GGUF tensor {gguf_name!r} for a {arch} model")


def unpermute_qk(gguf_name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Undo the row permutation llama.cpp's converter applies to Q and K.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)... of each head while HF rotates the two
    halves (x_i, x_{i + d/2}); the converter reordered each head's rows to turn one into the
    other. Reading a head's rows as [d/2, 2] and transposing to [2, d/2] puts them back."""
    if ".attn_q." not in gguf_name and ".attn_k." not in gguf_name:
        return weight
    rows = weight.shape[0]
    heads = rows // config.head_dim              # a layer's own KV heads, for K
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())
