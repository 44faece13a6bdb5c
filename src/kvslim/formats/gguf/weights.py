"""Read a model's weights straight from a GGUF file (config.json `quantization_config`
{"quant_method": "gguf", "file": ...}, written by `import_gguf`): linear weights of the types
kvslim keeps (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) as their decoded blocks (qvalues, scales, mins,
qtype; formats/gguf/blocks.py, quantization/gguf_blocks.py), the token embeddings and LM head the
same way when the config says so, every other tensor dequantized to float32; all under HF names and
with llama.cpp's Q/K row order undone. Reordering Q/K rows moves whole rows of blocks, so it is
exact on the blocks."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kvslim.errors import WeightsError
from kvslim.formats.gguf.blocks import kept_type, tensor_blocks
from kvslim.formats.gguf.file import GGUFFile, dequantize_tensor
from kvslim.formats.gguf.importer import (DERIVED_TENSORS, from_gguf, gguf_arch, hf_tensor_name,
                                        is_linear)
from kvslim.models.config import ModelConfig


def _kept_in_blocks(name: str, config: ModelConfig) -> bool:
    spec = config.quantization
    return (is_linear(name) or (name == "token_embd.weight" and spec.embedding)
            or (name == "output.weight" and spec.lm_head))


def gguf_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the file: block leaves for the quantized ones."""
    gguf = GGUFFile.open(path)
    for tensor in gguf.tensors:
        if tensor.name in DERIVED_TENSORS:
            continue
        name = hf_tensor_name(tensor.name, gguf_arch(config))
        if not _kept_in_blocks(tensor.name, config):
            yield name, from_gguf(tensor.name, dequantize_tensor(tensor), config)
            continue
        kind, cols = tensor.tensor_type.name, int(tensor.shape[0])
        if not kept_type(kind, cols):
            raise WeightsError(f"{path.name}: tensor {tensor.name!r} is {kind}, which kvslim "
                               "does not keep quantized (import the file with --dtype float32)")
        prefix = name.removesuffix(".weight")
        for leaf, value in tensor_blocks(tensor).items():
            yield f"{prefix}.{leaf}", (value if leaf == "qtype"
                                       else from_gguf(tensor.name, value, config))


def gguf_runtime_bytes(path: Path, config: ModelConfig, float_itemsize: int) -> int:
    """Bytes of the weights a model running from the file reads: the tensors kept in blocks
    at the file's block size, every other one at `float_itemsize` per element."""
    return sum(int(t.n_bytes) if _kept_in_blocks(t.name, config)
               else int(np.prod([int(d) for d in t.shape])) * float_itemsize
               for t in GGUFFile.open(path).tensors if t.name not in DERIVED_TENSORS)


def gguf_parameter_count(path: Path, config: ModelConfig) -> int:
    """Elements of every weight in the file (the tied LM head is not stored there)."""
    return sum(int(np.prod([int(d) for d in t.shape])) for t in GGUFFile.open(path).tensors
               if t.name not in DERIVED_TENSORS)
