"""`ModelConfig`: the validated, architecture-agnostic view of an HF `config.json`."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvslim.dtypes import (KV_SCALE_DTYPE, QUANTIZED_KV_DTYPES, is_quantized_kv, packed_kv_bits,
                           parse_dtype)
from kvslim.kernels.lowbit_codes import block_bytes
from kvslim.errors import ConfigError
from kvslim.layers.rope import ROPE_TYPES_PAST_CONTEXT, validate_rope_scaling
from kvslim.models.hf_fields import (LAYER_KV_HEADS_KEY, activation_from_hf,
                                     check_rotary_fraction, layer_kv_heads_from_hf, rope_from_hf)
from kvslim.models.shape_only import MLAConfig, MoEConfig
from kvslim.quantization import QuantSpec

# The families (models/base.py's `Family`), by architecture. models/families.py registers
# them when the package kvslim.models is imported; this file reads them and never imports
# them, so that each family's file can name ModelConfig without an import circle.
BY_ARCHITECTURE: dict[str, Any] = {}
# Architectures a model in models/ implements: the engine runs them.
SUPPORTED_ARCHITECTURES: dict[str, str] = {}
# Architectures read for their shapes only (`from_hf_dict(..., runnable=False)`), so that the
# memory planner sizes them from the same parser; nothing in kvslim runs them (none today).
SHAPE_ONLY_ARCHITECTURES: dict[str, str] = {}
ARCHITECTURES: dict[str, str] = {}


def register_families(families) -> None:
    """Make `families` (in message order) known to ModelConfig."""
    for f in families:
        BY_ARCHITECTURE[f.architecture] = f
        (SUPPORTED_ARCHITECTURES if f.runnable else SHAPE_ONLY_ARCHITECTURES)[f.architecture] \
            = f.model_type
        ARCHITECTURES[f.architecture] = f.model_type

# The config.json key `kvslim prune` records what it did under: a pruned model is not pruned
# again, and uptraining keeps its zeros.
PRUNING_KEY = "kvslim_pruning"


@dataclass
class ModelConfig:
    """Everything the model and the engine need, read from (and written back to) HF config.json.

    `raw` keeps the original dict so that writers preserve fields kvslim does not interpret.
    `moe` is set for mixture-of-experts models (Mixtral, Qwen3-MoE, DeepSeek), `mla` for
    DeepSeek's latent attention. `name` and
    `source` say where the config came from (for display); they take no part in equality."""

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
    qk_norm: bool = False              # RMSNorm of each query and key head before RoPE (Qwen3)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    # Per layer, "sliding_attention" (the window) or "full_attention"; None: every layer has
    # `sliding_window` (Mistral) or none. Gemma 3 mixes them.
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"           # the gated MLP's activation (Gemma: gelu_pytorch_tanh)
    query_pre_attn_scalar: float | None = None   # attention scale = its ** -0.5 (Gemma)
    rope_local_theta: float | None = None        # RoPE base of the sliding layers (Gemma 3)
    torch_dtype: str = "float32"
    # KV heads of each layer when they differ (a non-uniform GQA conversion); None: every layer
    # has num_key_value_heads, which is then the widest layer's count.
    layer_kv_heads: tuple[int, ...] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    name: str = field(default="", compare=False)
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.layer_kv_heads is not None:
            heads = tuple(self.layer_kv_heads)
            uniform = len(set(heads)) == 1 and len(heads) == self.num_hidden_layers
            self.layer_kv_heads = None if uniform else heads
            if uniform:
                self.num_key_value_heads = heads[0]
        self.validate()

    # ---- derived -------------------------------------------------------------------------
    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def runnable(self) -> bool:
        """Whether a model in models/ implements this architecture."""
        return self.architecture in SUPPORTED_ARCHITECTURES

    @property
    def quantization(self) -> QuantSpec | None:
        """How the decoder's linear layers are quantized (config.json `quantization_config`)."""
        cfg = self.raw.get("quantization_config")
        return None if cfg is None else QuantSpec.from_hf(cfg)

    @property
    def pruning(self) -> dict | None:
        """What `kvslim prune` did to the decoder's linears (method, sparsity, pattern)."""
        return self.raw.get(PRUNING_KEY)

    @property
    def v_head_dim(self) -> int:
        """Size of a value head: head_dim, except in MLA, where K heads are nope + rope wide."""
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def kv_heads_per_layer(self) -> tuple[int, ...]:
        """Every layer's KV head count (all equal unless `layer_kv_heads` is set)."""
        return self.layer_kv_heads or (self.num_key_value_heads,) * self.num_hidden_layers

    def kv_heads_of(self, layer_idx: int) -> int:
        return self.kv_heads_per_layer[layer_idx]

    @property
    def positions_past_context(self) -> bool:
        """Whether its RoPE defines positions past max_position_embeddings (layers/rope.py)."""
        return (self.rope_scaling or {}).get("rope_type", "default") in ROPE_TYPES_PAST_CONTEXT

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: it sees the whole context)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None
                     for t in self.layer_types)

    @property
    def attention_kind(self) -> str:
        if self.mla:
            return "MLA"
        if self.layer_kv_heads is not None:
            return "GQA (per layer)"
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_key_value_heads == 1 else "GQA"

    def kv_elements_per_token(self, num_kv_heads: int | None = None) -> int:
        """Elements of K and V cached for one token, all layers: layers * kv_heads * (K + V head
        size), i.e. 2 * layers * kv_heads * head_dim for every model the engine runs. This is the
        one place the formula is written: the engine's allocator, `kvslim info` and the memory
        planner all come here. `num_kv_heads` prices the same model with another KV head count
        (its MHA or MQA equivalent). An MLA model's own cache is its latent layout instead
        (`MLAConfig.cache_elements_per_token`: one row per token and layer, what the engine
        stores, attention/latent_cache.py). A model with per-layer KV heads sums its layers'."""
        if self.mla is not None and num_kv_heads is None:
            return self.mla.cache_elements_per_token(self.num_hidden_layers)
        return self._kv_heads_summed_over_layers(num_kv_heads) * (self.head_dim + self.v_head_dim)

    def _kv_heads_summed_over_layers(self, num_kv_heads: int | None) -> int:
        """KV heads summed over layers: this model's, or `num_kv_heads` in every layer."""
        if num_kv_heads is not None:
            return self.num_hidden_layers * num_kv_heads
        return sum(self.kv_heads_per_layer)

    def kv_bytes_per_token(self, dtype: torch.dtype | str = torch.float16) -> int:
        """Bytes of K and V for one token, all layers, cached in `dtype`."""
        return self.kv_elements_per_token() * parse_dtype(dtype).itemsize

    def kv_scales_per_token(self, num_kv_heads: int | None = None) -> int:
        """Scales a quantized (int8/fp8) cache stores beside one token's elements, all layers:
        one per K and per V head (`attention/kv_cache.py`); for an MLA model's latent layout one
        per row and layer (`attention/latent_cache.py`)."""
        if self.mla is not None and num_kv_heads is None:
            return self.num_hidden_layers
        return 2 * self._kv_heads_summed_over_layers(num_kv_heads)

    def kv_scale_bytes_per_token(self, num_kv_heads: int | None = None) -> int:
        """Bytes of those scales (float16, `KV_SCALE_DTYPE`), added to `kv_bytes_per_token`."""
        return self.kv_scales_per_token(num_kv_heads) * KV_SCALE_DTYPE.itemsize

    def kv_storage_bytes_per_token(self, element_bits: int, scaled: bool,
                                   num_kv_heads: int | None = None) -> int:
        """What a KV cache stores per token, all layers: elements of `element_bits` (int4: two
        a byte), plus the scales of an int8/fp8 cache (`scaled`). The engine's, the planner's
        and a tensor-parallel rank's bytes all come here."""
        elements = -(-self.kv_elements_per_token(num_kv_heads) * element_bits // 8)
        return elements + (self.kv_scale_bytes_per_token(num_kv_heads) if scaled else 0)

    def kv_cache_bytes_per_token(self, kv_cache_dtype: torch.dtype | str,
                                 block_size: int = 16) -> int:
        """What the engine's cache stores per token: the elements in `kv_cache_dtype` plus the
        scales of a quantized one; a packed cache's block over its tokens, rounded up."""
        if packed_kv_bits(kv_cache_dtype):
            return -(-self.kv_cache_block_bytes(kv_cache_dtype, block_size) // block_size)
        dtype = parse_dtype(QUANTIZED_KV_DTYPES.get(kv_cache_dtype, kv_cache_dtype))
        return self.kv_storage_bytes_per_token(8 * dtype.itemsize,
                                               is_quantized_kv(dtype))

    def kv_cache_block_bytes(self, kv_cache_dtype: torch.dtype | str, block_size: int) -> int:
        """One block of `block_size` tokens, all layers, exactly (kernels/lowbit_codes.py)."""
        bits = packed_kv_bits(kv_cache_dtype)
        if bits is None:
            return block_size * self.kv_cache_bytes_per_token(kv_cache_dtype)
        if self.mla is not None:
            raise ConfigError(f"kv_cache_dtype={kv_cache_dtype} is not built for MLA's latent "
                              "cache")
        return sum(block_bytes(h, self.head_dim, bits, block_size)
                   for h in self.kv_heads_per_layer)

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        if self.architecture not in ARCHITECTURES:
            self.require_runnable()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})")
        self._validate_layer_kv_heads()
        if self.head_dim % 2 != 0:
            raise ConfigError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and self.runnable:     # RoPE matters only to a run
            # MLA rotates only each head's qk_rope_head_dim part (the shared RoPE key)
            rotated = self.head_dim if self.mla is None else self.mla.qk_rope_head_dim
            validate_rope_scaling(self.rope_scaling, rotated)
        parse_dtype(self.torch_dtype)
        if self.runnable:
            self.quantization                       # noqa: B018 (validates quantization_config)

    def _validate_layer_kv_heads(self) -> None:
        heads = self.layer_kv_heads
        if heads is None:
            return
        key = LAYER_KV_HEADS_KEY
        if len(heads) != self.num_hidden_layers:
            raise ConfigError(f"config.json: {key} has {len(heads)} entries for "
                              f"{self.num_hidden_layers} layers")
        for i, k in enumerate(heads):
            if not isinstance(k, int) or k <= 0 or self.num_attention_heads % k:
                raise ConfigError(f"config.json: {key}[{i}] = {k!r} must be a positive divisor of "
                                  f"num_attention_heads ({self.num_attention_heads})")
        if self.num_key_value_heads != max(heads):
            raise ConfigError(f"config.json: num_key_value_heads ({self.num_key_value_heads}) "
                              f"must be the largest entry of {key} ({max(heads)})")

    def require_runnable(self) -> None:
        if not self.runnable:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; kvslim supports "
                + ", ".join(SUPPORTED_ARCHITECTURES))

    # ---- HF config.json ------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, runnable: bool = True, name: str = "",
                     source: str = "") -> "ModelConfig":
        """`runnable=False` also accepts SHAPE_ONLY_ARCHITECTURES (for the memory planner)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _architecture_from_model_type(cfg.get("model_type"),
                                                                     runnable)
        hidden_act = activation_from_hf(cfg)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope_theta, rope_scaling = rope_from_hf(cfg)
            check_rotary_fraction(cfg)
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            layer_heads = layer_kv_heads_from_hf(cfg)
            # the family's own fields (Qwen2's biases, Gemma 3's layers, the experts, ...)
            family = BY_ARCHITECTURE[arch].hf_fields(cfg) if arch in BY_ARCHITECTURE else {}
            fields = dict(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=(max(layer_heads) if layer_heads
                                     else int(cfg.get("num_key_value_heads") or heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", False)),
                o_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window", True)
                                else None),
                torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
                layer_kv_heads=layer_heads,
                raw=copy.deepcopy(cfg),
                name=name,
                source=source,
                hidden_act=hidden_act,
            )
            config = cls(**{**fields, **family})
        except KeyError as e:
            raise ConfigError(f"config.json: missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json: invalid value ({e})") from None
        if runnable:
            config.require_runnable()
        return config

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, runnable: bool = True) -> "ModelConfig":
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory not found: {path}")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"no config.json in {path}")
        return cls.from_file(cfg_path, runnable=runnable)

    @classmethod
    def from_file(cls, config_json: str | Path, *, runnable: bool = True) -> "ModelConfig":
        """A config.json by path; named after its directory."""
        path = Path(config_json)
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path} is not a config.json (expected a JSON object)")
        return cls.from_hf_dict(cfg, runnable=runnable, name=path.parent.name,
                                source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that both transformers and kvslim read back to this config."""
        cfg = copy.deepcopy(self.raw)
        for stale in ("rope_scaling", "rope_parameters", "torch_dtype", LAYER_KV_HEADS_KEY):
            cfg.pop(stale, None)
        if self.layer_kv_heads is not None:
            cfg[LAYER_KV_HEADS_KEY] = list(self.layer_kv_heads)
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
            hidden_act=self.hidden_act,
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
        BY_ARCHITECTURE[self.architecture].write_hf(self, cfg)
        return cfg

    def replace(self, **changes: Any) -> "ModelConfig":
        """A validated copy with some fields changed (e.g. num_key_value_heads after surgery)."""
        fields = {k: copy.deepcopy(v) for k, v in self.__dict__.items()}
        fields.update(changes)
        return ModelConfig(**fields)


def _architecture_from_model_type(model_type: str | None, runnable: bool = True) -> str:
    for arch, mt in (SUPPORTED_ARCHITECTURES if runnable else ARCHITECTURES).items():
        if mt == model_type:
            return arch
    raise ConfigError(f"config.json: no supported architecture (architectures missing, "
                      f"model_type={model_type!r})")
