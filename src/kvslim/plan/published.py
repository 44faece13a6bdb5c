"""What the memory planner knows about a model: `ModelSpec` (the shapes that decide weight and
KV-cache bytes), read from any HF `config.json`, plus a built-in table of published configs.

The table holds excerpts of each model's own `config.json`, keys spelled as in the file, so every
number can be checked against its source repository; nothing here is derived by hand. Parameter
counts are computed from these shapes (`parameter_counts`), never copied from a model card."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvslim.errors import ConfigError
from kvslim.models.config import ModelConfig

_LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "tie_word_embeddings": False}

PUBLISHED_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "Llama-2-7B": ("meta-llama/Llama-2-7b-hf", {
        **_LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "torch_dtype": "float16"}),
    # https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json
    "Llama-2-13B": ("meta-llama/Llama-2-13b-hf", {
        **_LLAMA, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "torch_dtype": "float16"}),
    # https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json
    "Llama-2-70B": ("meta-llama/Llama-2-70b-hf", {
        **_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "torch_dtype": "float16"}),
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "Llama-3-8B": ("meta-llama/Meta-Llama-3-8B", {
        **_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "torch_dtype": "bfloat16"}),
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    "Llama-3-70B": ("meta-llama/Meta-Llama-3-70B", {
        **_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "torch_dtype": "bfloat16"}),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "Mistral-7B": ("mistralai/Mistral-7B-v0.1", {
        **_LLAMA, "architectures": ["MistralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
        "sliding_window": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16"}),
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    "Mixtral-8x7B": ("mistralai/Mixtral-8x7B-v0.1", {
        **_LLAMA, "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "torch_dtype": "bfloat16"}),
    # https://huggingface.co/Qwen/Qwen2-7B/blob/main/config.json
    "Qwen2-7B": ("Qwen/Qwen2-7B", {
        **_LLAMA, "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
        "use_sliding_window": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16"}),
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json
    "SmolLM2-135M": ("HuggingFaceTB/SmolLM2-135M", {
        **_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"}),
    # https://huggingface.co/deepseek-ai/DeepSeek-V2/blob/main/config.json
    # MLA attention (kv_lora_rank, qk_rope_head_dim) and fine-grained MoE (160 routed + 2 shared).
    "DeepSeek-V2": ("deepseek-ai/DeepSeek-V2", {
        "architectures": ["DeepseekV2ForCausalLM"], "hidden_act": "silu", "hidden_size": 5120,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 60,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 160,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}),
}


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    first_dense_layers: int = 0        # leading layers that keep a dense MLP (DeepSeek)
    layer_freq: int = 1                # every layer_freq-th layer after those is MoE


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-head latent attention: the cache holds one compressed latent of
    `kv_lora_rank` plus one shared RoPE key of `qk_rope_head_dim` per token and layer."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str                        # HF repository or local path the shapes come from
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int                      # query/key head size (MLA: nope + rope part)
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    moe: MoEShape | None = None
    mla: MLAShape | None = None

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def attention_kind(self) -> str:
        if self.mla:
            return "MLA"
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_key_value_heads == 1 else "GQA"


# ---- reading configs -------------------------------------------------------------------------
def builtin_names() -> list[str]:
    return list(PUBLISHED_CONFIGS)


def builtin_spec(name: str) -> ModelSpec | None:
    """A built-in model by its name or its HF repository, case-insensitively; None if unknown."""
    for key, (source, cfg) in PUBLISHED_CONFIGS.items():
        if name.lower() in (key.lower(), source.lower()):
            return spec_from_hf_config(cfg, key, source)
    return None


def spec_from_file(config_json: Path, name: str | None = None) -> ModelSpec:
    try:
        cfg = json.loads(config_json.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {config_json}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{config_json} is not a config.json (expected a JSON object)")
    return spec_from_hf_config(cfg, name or config_json.parent.name, str(config_json))


def spec_from_hf_config(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    arch = (cfg.get("architectures") or [None])[0] or cfg.get("model_type")
    try:
        if arch in ("DeepseekV2ForCausalLM", "deepseek_v2"):
            return _deepseek_v2_spec(cfg, _common(cfg, name, source, "DeepseekV2ForCausalLM"))
        if arch in ("MixtralForCausalLM", "mixtral"):
            return _mixtral_spec(cfg, _common(cfg, name, source, "MixtralForCausalLM"))
    except KeyError as e:
        raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None
    # Everything the engine runs goes through the engine's own parser, so that the planner's
    # head counts and head_dim are the ones the KV cache is allocated from.
    mc = ModelConfig.from_hf_dict(cfg)
    return ModelSpec(
        name=name, source=source, architecture=mc.architecture,
        num_hidden_layers=mc.num_hidden_layers, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
        vocab_size=mc.vocab_size, max_position_embeddings=mc.max_position_embeddings,
        tie_word_embeddings=mc.tie_word_embeddings, torch_dtype=mc.torch_dtype,
        qkv_bias=mc.qkv_bias, o_bias=mc.o_bias, mlp_bias=mc.mlp_bias,
        sliding_window=mc.sliding_window)


def _common(cfg: dict[str, Any], name: str, source: str, arch: str) -> dict[str, Any]:
    heads = int(cfg["num_attention_heads"])
    return dict(
        name=name, source=source, architecture=arch,
        num_hidden_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))


def _mixtral_spec(cfg: dict[str, Any], common: dict[str, Any]) -> ModelSpec:
    head_dim = int(cfg.get("head_dim") or common["hidden_size"] // common["num_attention_heads"])
    moe = MoEShape(num_experts=int(cfg["num_local_experts"]),
                   num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   expert_intermediate_size=common["intermediate_size"])
    return ModelSpec(**common, head_dim=head_dim, moe=moe)


def _deepseek_v2_spec(cfg: dict[str, Any], common: dict[str, Any]) -> ModelSpec:
    mla = MLAShape(kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                   qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                   v_head_dim=int(cfg["v_head_dim"]),
                   q_lora_rank=cfg.get("q_lora_rank"))
    moe = None
    if cfg.get("n_routed_experts"):
        moe = MoEShape(num_experts=int(cfg["n_routed_experts"]),
                       num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                       expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                       num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                       first_dense_layers=int(cfg.get("first_k_dense_replace", 0)),
                       layer_freq=int(cfg.get("moe_layer_freq", 1)))
    return ModelSpec(**common, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                     qkv_bias=bool(cfg.get("attention_bias", False)), moe=moe, mla=mla)


# ---- parameter counts --------------------------------------------------------------------------
def parameter_counts(spec: ModelSpec) -> tuple[int, int]:
    """(total, active per token) parameters from the shapes. They differ only for MoE models,
    where every expert must be resident but each token runs `num_experts_per_tok` of them."""
    h, layers = spec.hidden_size, spec.num_hidden_layers
    embeddings = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    total = active = embeddings + h                         # + the final norm
    attention = _mla_params(spec) if spec.mla else _attention_params(spec)
    for layer in range(layers):
        mlp_total, mlp_active = _mlp_params(spec, layer)
        total += attention + 2 * h + mlp_total              # 2 norms per layer
        active += attention + 2 * h + mlp_active
    return total, active


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _attention_params(spec: ModelSpec) -> int:
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    return (_linear(h, q, spec.qkv_bias) + 2 * _linear(h, kv, spec.qkv_bias)
            + _linear(q, h, spec.o_bias))


def _mla_params(spec: ModelSpec) -> int:
    """DeepSeek-V2 attention: low-rank Q (with its norm), the joint KV down-projection that
    produces the cached latent + RoPE key, its norm, the KV up-projection and the output."""
    m, h, heads = spec.mla, spec.hidden_size, spec.num_attention_heads
    q_out = heads * spec.head_dim
    if m.q_lora_rank:
        q = _linear(h, m.q_lora_rank, spec.qkv_bias) + m.q_lora_rank + m.q_lora_rank * q_out
    else:
        q = h * q_out
    kv_down = _linear(h, m.kv_lora_rank + m.qk_rope_head_dim, spec.qkv_bias) + m.kv_lora_rank
    kv_up = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv_down + kv_up + _linear(heads * m.v_head_dim, h, spec.qkv_bias)


def _swiglu(hidden: int, intermediate: int, bias: bool) -> int:
    return 2 * _linear(hidden, intermediate, bias) + _linear(intermediate, hidden, bias)


def _mlp_params(spec: ModelSpec, layer: int) -> tuple[int, int]:
    h, moe = spec.hidden_size, spec.moe
    is_moe = (moe is not None and layer >= moe.first_dense_layers
              and (layer - moe.first_dense_layers) % moe.layer_freq == 0)
    if not is_moe:
        dense = _swiglu(h, spec.intermediate_size, spec.mlp_bias)
        return dense, dense
    expert = _swiglu(h, moe.expert_intermediate_size, False)
    shared = _swiglu(h, moe.expert_intermediate_size * moe.num_shared_experts, False) \
        if moe.num_shared_experts else 0
    router = h * moe.num_experts
    return (router + shared + moe.num_experts * expert,
            router + shared + moe.num_experts_per_tok * expert)
