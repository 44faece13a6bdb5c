"""Export an HF-format model directory as a GGUF file that llama.cpp and Ollama run, in the GGUF
architecture its family's layout names (the `llama` one for Llama, Mistral and Mixtral; a
family's checkpoint names, such as fused projections, kept where its files keep them): the
inverse of `importer`, using the same tensor-name tables (archs.py).

Like llama.cpp's own converter, it reorders Q and K rows of `llama` files (llama.cpp's RoPE
rotates adjacent pairs there, HF's rotates halves), keeps 1-D tensors (norms, biases) and MoE
routers in F32, stacks each MoE layer's experts (moe.py), and writes the byte-level
BPE vocabulary with llama.cpp's token types. Everything is read and checked before the output is
opened, and the file is written under a temporary name and renamed when complete, so a failed
export leaves nothing behind. Tensors are converted and written one at a time."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvslim.errors import ConfigError
from kvslim.models.config import ModelConfig
from kvslim.dtypes import parse_dtype
from kvslim.formats.gguf.archs import EXPORT_ARCHITECTURES, LAYER_TENSORS, permutes_qk
from kvslim.formats.gguf.importer import GLOBAL_TENSORS
from kvslim.formats.gguf.moe import add_moe_metadata, check_exportable, is_router, stack_experts
from kvslim.models.families import family_of
from kvslim.formats.gguf.tokenizer import CONTROL, LLAMA3_SPLIT, USER_DEFINED
from kvslim.formats.loader import load_model
from kvslim.layers.rope import rope_inv_freq
from kvslim.tokenizer.tokenizer import Tokenizer

EXPORT_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
# 4-bit exports keep the token embeddings (and an untied output) at Q8_0, as llama.cpp's own
# Q4_0/Q4_1 files keep them at a higher precision (SmolLM2's Q4_1 file: Q8_0 token_embd).
EMBEDDING_TENSORS = ("token_embd.weight", "output.weight")
NORMAL, UNUSED = 1, 5                 # llama.cpp token types (gguf.TokenType)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` for each regex split llama.cpp knows, so it cuts text where HF does.
SPLIT_PRE_NAMES = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}

_HF_GLOBAL = {hf: gguf for gguf, hf in GLOBAL_TENSORS.items()}
_HF_LAYER = {arch: {hf: gguf for gguf, hf in names.items()}
             for arch, names in LAYER_TENSORS.items()}
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_GLOBAL_NAME = re.compile(r"(.+)\.(weight|bias)")


def export_gguf(model_dir: str | Path, out_path: str | Path, dtype: str = "f16",
                show_progress: bool = True) -> Path:
    import gguf
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"unknown GGUF dtype {dtype!r}; choose one of {', '.join(EXPORT_DTYPES)}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = ModelConfig.from_dir(model_dir)
    if config.quantization is not None:
        raise ConfigError(f"{model_dir} holds quantized weights ({config.quantization.method}); "
                          "export-gguf writes from float weights: export its float32 import "
                          "(import-gguf --dtype float32) instead")
    family = family_of(config)
    if not family.supports_gguf_export:
        raise ConfigError(f"export-gguf writes {', '.join(sorted(set(EXPORT_ARCHITECTURES.values())))} "
                          f"GGUF files: {config.architecture} cannot be exported yet")
    arch = family.gguf.arch
    if config.moe is not None:
        check_exportable(config)
    vocab = gguf_vocab(model_dir, config)
    model = load_model(model_dir, dtype=parse_dtype(config.torch_dtype))
    # the family's checkpoint names (Phi-3's fused projections), which its GGUF files keep; an
    # MoE model's experts stacked under kvslim's names instead
    state = model.hf_state_dict()
    state = (stack_experts(state, config) if config.moe
             else family.to_checkpoint(state, config))
    tensors = tensor_plan(state, config, dtype, arch)
    tmp = out_path.with_name(f".{out_path.name}.partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        add_model_metadata(writer, config, model_dir.name, dtype)
        vocab.add_to(writer)
        for t in tensors:
            writer.add_tensor_info(t.gguf_name, t.stored_shape, t.numpy_dtype, t.nbytes,
                                   raw_dtype=t.raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tqdm(tensors, desc=f"writing {out_path.name}", unit="tensor",
                      disable=not show_progress):
            writer.write_tensor_data(t.encode())
        writer.close()
        os.replace(tmp, out_path)
    except OSError as e:
        raise ConfigError(f"cannot write {out_path}: {e.strerror or e}") from None
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out_path


# ---- metadata ------------------------------------------------------------------------------
def add_model_metadata(writer, config: ModelConfig, name: str, dtype: str) -> None:
    """The llama.* keys llama.cpp reads. Mistral's and Mixtral's sliding window has no llama.*
    key: llama.cpp runs such models with full attention, as its own converter does."""
    import gguf
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                  "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}
    writer.add_name(name)
    writer.add_file_type(file_types[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    # per-layer KV heads as llama.cpp reads them: one count, or an array with one per layer
    writer.add_head_count_kv(list(config.layer_kv_heads) if config.layer_kv_heads
                             else config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    if family_of(config).gguf.sliding_window and config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.moe is not None:
        add_moe_metadata(writer, config)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


@dataclass
class GGUFVocab:
    """A byte-level BPE vocabulary as llama.cpp stores it (`tokenizer.ggml.*`)."""
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]        # bos / eos / unk / pad -> id
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def add_to(self, writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
                  "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}
        for kind, token_id in self.special_ids.items():
            adders[kind](token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


def gguf_vocab(model_dir: Path, config: ModelConfig) -> GGUFVocab:
    tok = Tokenizer.from_dir(model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    bpe = spec.get("model") or {}
    if bpe.get("type") != "BPE" or bpe.get("byte_fallback"):
        raise ConfigError(f"{model_dir}: tokenizer is not byte-level BPE; kvslim exports "
                          "GPT-2 style (byte-level BPE) vocabularies only")
    tokens, types = _token_table(bpe.get("vocab") or {}, spec.get("added_tokens") or [],
                                 config.vocab_size, model_dir)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges") or []]
    special_ids = {}
    for kind in ("bos", "eos", "unk", "pad"):
        token_id = tok.token_id(tok.token_str(f"{kind}_token"))
        if token_id is None and kind in ("bos", "eos"):
            fallback = config.bos_token_id if kind == "bos" else (config.eos_token_ids or [None])[0]
            token_id = fallback
        if token_id is not None:
            special_ids[kind] = int(token_id)
    # What the tokenizer adds around plain text, observed rather than read from flags.
    with_specials = tok.encode("a", add_special_tokens=True)
    plain = tok.encode("a", add_special_tokens=False)
    added = len(with_specials) - len(plain)
    add_bos = added > 0 and with_specials[0] == special_ids.get("bos")
    add_eos = added > 0 and with_specials[-1] == special_ids.get("eos")
    return GGUFVocab(_pre_tokenizer_name(spec, model_dir), tokens, types, merges, special_ids,
                     add_bos, add_eos, tok.chat_template)


def _token_table(vocab: dict[str, int], added: list[dict[str, Any]], vocab_size: int,
                 model_dir: Path) -> tuple[list[str], list[int]]:
    """One token per embedding row, as llama.cpp's converter lays them out: added special tokens
    are CONTROL, other added tokens USER_DEFINED, rows without a token `[PAD<id>]` UNUSED."""
    by_id: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in vocab.items()}
    for a in added:
        by_id[int(a["id"])] = (a["content"], CONTROL if a.get("special") else USER_DEFINED)
    if by_id and max(by_id) >= vocab_size:
        raise ConfigError(f"{model_dir}: tokenizer has token id {max(by_id)}, but the model's "
                          f"vocab_size is {vocab_size}")
    table = [by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(vocab_size)]
    return [t for t, _ in table], [kind for _, kind in table]


def _pre_tokenizer_name(spec: dict[str, Any], model_dir: Path) -> str:
    """llama.cpp's name for how the tokenizer splits text before BPE. llama.cpp does not read
    the split rules from the file, so an unknown one would tokenize differently: refuse it."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    normalizer = (spec.get("normalizer") or {}).get("type")
    # NFC changes no text a byte-level vocabulary was trained on in practice (Qwen2 sets it).
    name = _split_name(steps, kinds) if normalizer in (None, "NFC") else None
    if name is None:
        raise ConfigError(f"{model_dir}: tokenizer pre-tokenizer {kinds or None} "
                          f"(normalizer {normalizer}) has no llama.cpp equivalent kvslim knows; "
                          "supported: GPT-2 ByteLevel, SmolLM digits, Llama 3 and Qwen2 splits")
    return name


def _split_name(steps: list[dict[str, Any]], kinds: list[str]) -> str | None:
    if not kinds or kinds[-1] != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return None
    own_regex = steps[-1].get("use_regex", True)       # ByteLevel's built-in GPT-2 split
    if kinds == ["ByteLevel"] and own_regex:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and own_regex:
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not own_regex:
        return SPLIT_PRE_NAMES.get((steps[0].get("pattern") or {}).get("Regex"))
    return None


# ---- tensors -------------------------------------------------------------------------------
@dataclass
class TensorPlan:
    """One tensor of the output: where its values come from and how they are stored."""
    gguf_name: str
    values: torch.Tensor               # HF layout [out, in], Q/K rows already permuted
    qtype: Any                         # gguf.GGMLQuantizationType

    @property
    def is_raw(self) -> bool:
        """Stored as bytes (BF16, Q8_0) rather than as a numpy float array."""
        return self.qtype.name not in ("F32", "F16")

    @property
    def numpy_dtype(self):
        return np.uint8 if self.is_raw else (np.float32 if self.qtype.name == "F32" else np.float16)

    @property
    def raw_dtype(self):
        return self.qtype if self.is_raw else None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        from gguf.quants import quant_shape_to_byte_shape
        shape = tuple(self.values.shape)
        return quant_shape_to_byte_shape(shape, self.qtype) if self.is_raw else shape

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.stored_shape)) * np.dtype(self.numpy_dtype).itemsize

    def encode(self) -> np.ndarray:
        from gguf.quants import quantize
        return quantize(self.values.to(torch.float32).numpy(), self.qtype)


def tensor_plan(state: dict[str, torch.Tensor], config: ModelConfig, dtype: str,
                arch: str = "llama") -> list[TensorPlan]:
    from gguf import GGMLQuantizationType as Q
    target = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0,
              "q4_1": Q.Q4_1}[dtype]
    plan = []
    if (config.rope_scaling or {}).get("rope_type") == "llama3":
        plan.append(TensorPlan("rope_freqs.weight", llama3_rope_factors(config), Q.F32))
    for hf_name, value in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue                   # llama.cpp reuses token_embd when `output` is absent
        name = gguf_tensor_name(hf_name, arch)
        kind = Q.Q8_0 if target in (Q.Q4_0, Q.Q4_1) and name in EMBEDDING_TENSORS else target
        kind = Q.F32 if is_router(name) else kind
        value = permute_qk(name, value, config) if permutes_qk(arch) else value
        plan.append(TensorPlan(name, value, storage_type(value, kind)))
    return plan


def storage_type(value: torch.Tensor, target):
    """Norms and biases stay F32 (llama.cpp's rule); Q8_0 needs rows in whole 32-element blocks,
    so other matrices fall back to F16, as llama.cpp's converter does."""
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES
    if value.dim() == 1:
        return Q.F32
    if value.shape[-1] % GGML_QUANT_SIZES[target][0] != 0:
        return Q.F16
    return target


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    if m := _HF_LAYER_NAME.fullmatch(hf_name):
        layer, part, kind = m.groups()
        if part in _HF_LAYER[arch]:
            return f"blk.{layer}.{_HF_LAYER[arch][part]}.{kind}"
    elif (m := _HF_GLOBAL_NAME.fullmatch(hf_name)) and m.group(1) in _HF_GLOBAL:
        return f"{_HF_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise ConfigError(f"no GGUF name for weight {hf_name!r} of a {arch} model")


def permute_qk(gguf_name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """llama.cpp's Q/K row order, the inverse of `importer.unpermute_qk`: within each head,
    rows [first half | second half] become interleaved pairs (x_i, x_{i + d/2})."""
    if ".attn_q." not in gguf_name and ".attn_k." not in gguf_name:
        return weight
    rows = weight.shape[0]
    heads = rows // config.head_dim              # a layer's own KV heads, for K
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def llama3_rope_factors(config: ModelConfig) -> torch.Tensor:
    """Llama 3.1 scaling as llama.cpp carries it: one divisor per frequency (`rope_freqs`),
    taken from kvslim's own scaled frequencies so that both run the same rotation."""
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
    scaled = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return (plain / scaled).to(torch.float32)
