"""`ModelConfig`: the validated, architecture-agnostic view of an HF `config.json`."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvslim.errors import ConfigError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of float32, bfloat16, float16")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class ModelConfig:
    """Everything the model and the engine need, read from (and written back to) HF config.json.

    `raw` keeps the original dict so that writers preserve fields kvslim does not interpret."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived -------------------------------------------------------------------------
    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_kind(self) -> str:
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_key_value_heads == 1 else "GQA"

    def kv_bytes_per_token(self, dtype: torch.dtype | str = torch.float16) -> int:
        """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * element size."""
        itemsize = parse_dtype(dtype).itemsize
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; kvslim supports "
                + ", ".join(SUPPORTED_ARCHITECTURES))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 != 0:
            raise ConfigError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"config.json: unsupported rope_scaling type {rope_type!r}; "
                                  f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        parse_dtype(self.torch_dtype)

    # ---- HF config.json ------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _architecture_from_model_type(cfg.get("model_type"))
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"config.json: hidden_act {hidden_act!r} is not supported (only silu)")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope_theta, rope_scaling = _rope_from_hf(cfg)
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            is_qwen2 = arch == "Qwen2ForCausalLM"
            use_sw = cfg.get("use_sliding_window", not is_qwen2)
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=True if is_qwen2 else bool(cfg.get("attention_bias", False)),
                o_bias=False if is_qwen2 else bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=cfg.get("sliding_window") if use_sw else None,
                torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
                raw=copy.deepcopy(cfg),
            )
        except KeyError as e:
            raise ConfigError(f"config.json: missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json: invalid value ({e})") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory not found: {path}")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(cfg)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that both transformers and kvslim read back to this config."""
        cfg = copy.deepcopy(self.raw)
        for stale in ("rope_scaling", "rope_parameters", "torch_dtype"):
            cfg.pop(stale, None)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        cfg.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=(self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                          else (self.eos_token_ids or None)),
            dtype=self.torch_dtype,
        )
        if self.model_type != "qwen2":
            cfg["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        return cfg

    def replace(self, **changes: Any) -> "ModelConfig":
        """A validated copy with some fields changed (e.g. num_key_value_heads after surgery)."""
        fields = {k: copy.deepcopy(v) for k, v in self.__dict__.items()}
        fields.update(changes)
        return ModelConfig(**fields)


def _architecture_from_model_type(model_type: str | None) -> str:
    for arch, mt in SUPPORTED_ARCHITECTURES.items():
        if mt == model_type:
            return arch
    raise ConfigError(f"config.json: no supported architecture (architectures missing, "
                      f"model_type={model_type!r})")


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Both layouts: transformers v5 `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    merged.pop("type", None)
    if merged.get("rope_type", "default") == "default":
        return theta, None
    return theta, merged
