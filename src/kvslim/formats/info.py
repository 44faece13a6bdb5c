"""`kvslim info`: what a model directory holds, in numbers: shape, attention layout and KV-cache
cost per token, read from config.json and the safetensors headers without loading any weights."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvslim.dtypes import QUANTIZED_KV_DTYPES
from kvslim.models.config import ModelConfig
from kvslim.dtypes import dtype_name, parse_dtype
from kvslim.formats.loader import IGNORED_SUFFIXES, weight_files


@dataclass
class ModelInfo:
    model_dir: str
    architecture: str
    model_type: str
    num_parameters: int
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    group_size: int
    attention_kind: str
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    weights_dtype: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    quantization: str | None = None          # the linear layers' scheme, None for float
    kv_heads_per_layer: list[int] | None = None   # when layers differ (non-uniform GQA)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_info(model_dir: str | Path, kv_dtype: str | torch.dtype | None = None) -> ModelInfo:
    """`kv_dtype` defaults to the dtype the weights are stored in; "int8" and "fp8_e4m3" count
    the engine's quantized cache, scales included."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    kv_dtype = QUANTIZED_KV_DTYPES.get(kv_dtype) or parse_dtype(kv_dtype or config.torch_dtype)
    return ModelInfo(
        model_dir=str(model_dir),
        architecture=config.architecture,
        model_type=config.model_type,
        num_parameters=count_parameters(model_dir, config),
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        group_size=config.group_size,
        attention_kind=config.attention_kind,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        tie_word_embeddings=config.tie_word_embeddings,
        weights_dtype=config.torch_dtype,
        kv_cache_dtype=dtype_name(kv_dtype),
        kv_bytes_per_token=config.kv_cache_bytes_per_token(kv_dtype),
        quantization=None if config.quantization is None else config.quantization.describe(),
        kv_heads_per_layer=list(config.layer_kv_heads) if config.layer_kv_heads else None,
    )


def count_parameters(model_dir: str | Path, config: ModelConfig) -> int:
    """Elements of every stored weight. A tied LM head shares the embedding matrix, so it is not
    counted again even when a checkpoint stores a copy."""
    spec = config.quantization
    if spec is not None and spec.method == "gguf":
        from kvslim.formats.gguf.weights import gguf_parameter_count
        return gguf_parameter_count(Path(model_dir) / spec.file, config)
    return sum(numel for numel, _ in _stored(model_dir, config))


def weight_bytes(model_dir: str | Path, config: ModelConfig, float_itemsize: int) -> int:
    """Bytes of the weights as a model running with floats of `float_itemsize` bytes holds
    them: integer tensors (quantized codes, packed or not) at their stored size, float ones at
    the runtime's. A GGUF-backed model: the tensors it keeps in blocks at the file's size."""
    spec = config.quantization
    if spec is not None and spec.method == "gguf":
        from kvslim.formats.gguf.weights import gguf_runtime_bytes
        return gguf_runtime_bytes(Path(model_dir) / spec.file, config, float_itemsize)
    return sum(numel * (float_itemsize if dtype.is_floating_point else dtype.itemsize)
               for numel, dtype in _stored(model_dir, config))


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _stored(model_dir: str | Path, config: ModelConfig):
    """(elements, dtype) of every stored weight, a tied LM head's copy left out."""
    skip = ("lm_head.weight",) if config.tie_word_embeddings else ()
    for path in weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in skip or name.endswith(IGNORED_SUFFIXES):
                    continue
                sl = f.get_slice(name)
                yield (math.prod(sl.get_shape()),
                       _SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.float32))
