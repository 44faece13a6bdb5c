"""Read a model's weights straight from a GGUF file (config.json `quantization_config`
{"quant_method": "gguf", "file": ...}, written by `import_gguf`): Q4_0 and Q4_1 linear weights
as their 4-bit blocks (qvalues, scales, mins; layers/block_quant_linear.py), every other tensor
dequantized to float32, all under HF names and with llama.cpp's Q/K row order undone.

Q4_0 block: float16 d, then 16 bytes of 4-bit values (inputs 0-15 in the low nibbles, 16-31 in
the high ones), w = d * (q - 8). Q4_1 block: float16 d, float16 m, the same 16 bytes, w = d * q + m.
Reordering Q/K rows moves whole blocks' rows, so it is exact on the blocks."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvslim.errors import WeightsError
from kvslim.formats.gguf_file import GGUFFile, dequantize_tensor
from kvslim.formats.gguf_import import BLOCK_TYPES, hf_tensor_name, is_linear, unpermute_qk
from kvslim.models.config import ModelConfig

BLOCK = 32


def block_tensors(tensor: Any) -> dict[str, torch.Tensor]:
    """A Q4_0 / Q4_1 GGUF tensor [rows, in] as qvalues uint8 [rows, in] and float32 scales and
    mins [rows, in / 32]."""
    kind = tensor.tensor_type.name
    rows, cols = (int(d) for d in reversed(tensor.shape))
    head = 4 if kind == "Q4_1" else 2
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // BLOCK, head + BLOCK // 2)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8 * d
    qs = raw[..., head:]
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(rows, cols)
    return {"qvalues": torch.from_numpy(np.ascontiguousarray(q)),
            "scales": torch.from_numpy(d), "mins": torch.from_numpy(m)}


def gguf_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the file: block leaves for Q4_0/Q4_1 linears."""
    gguf = GGUFFile.open(path)
    for tensor in gguf.tensors:
        name = hf_tensor_name(tensor.name)
        if is_linear(tensor.name) and tensor.tensor_type.name in BLOCK_TYPES:
            prefix = name.removesuffix(".weight")
            for leaf, value in block_tensors(tensor).items():
                yield f"{prefix}.{leaf}", unpermute_qk(tensor.name, value, config)
        elif is_linear(tensor.name):
            raise WeightsError(f"{path.name}: linear tensor {tensor.name!r} is "
                               f"{tensor.tensor_type.name}; kvslim keeps only "
                               f"{' and '.join(BLOCK_TYPES)} linears quantized (import the file "
                               "with --dtype float32)")
        else:
            yield name, unpermute_qk(tensor.name, dequantize_tensor(tensor), config)


def gguf_parameter_count(path: Path, config: ModelConfig) -> int:
    """Elements of every weight in the file (the tied LM head is not stored there)."""
    return sum(int(np.prod([int(d) for d in t.shape])) for t in GGUFFile.open(path).tensors)
