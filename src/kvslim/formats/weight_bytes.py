"""How many bytes a model's weights take as stored: a safetensors checkpoint (float, GPTQ layout or
any other) from its headers, a GGUF file from its tensor table. Counted without loading a weight,
the tied LM head once. `linear` is the decoder's linear layers alone: what weight quantization
shrinks (embeddings, norms and the LM head stay in floating point)."""
from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from kvslim.formats.loader import weight_files
from kvslim.models.config import ModelConfig

# model.layers.3.self_attn.q_proj.qweight, model.layers.0.mlp.down_proj.weight, ...
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.\w+")


@dataclass
class WeightBytes:
    total: int
    linear: int

    def to_dict(self) -> dict:
        return asdict(self)


def stored_weight_bytes(model_dir: str | Path) -> WeightBytes:
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    spec = config.quantization
    if spec is not None and spec.method == "gguf":
        return gguf_weight_bytes(model_dir / spec.file)
    skip = "lm_head.weight" if config.tie_word_embeddings else None
    total = linear = 0
    for path in weight_files(model_dir):
        for name, size in _safetensors_sizes(path).items():
            if name != skip:
                total += size
                linear += size if is_linear_tensor(name) else 0
    return WeightBytes(total, linear)


def is_linear_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to one of the decoder's linear layers."""
    return _LINEAR.fullmatch(name) is not None


def gguf_weight_bytes(path: str | Path) -> WeightBytes:
    from kvslim.formats.gguf.file import GGUFFile
    from kvslim.formats.gguf.importer import is_linear
    tensors = GGUFFile.open(path).tensors
    return WeightBytes(sum(int(t.n_bytes) for t in tensors),
                       sum(int(t.n_bytes) for t in tensors if is_linear(t.name)))


def _safetensors_sizes(path: Path) -> dict[str, int]:
    """Tensor name -> bytes, from the header (8-byte length, then JSON with data offsets)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: entry["data_offsets"][1] - entry["data_offsets"][0]
            for name, entry in header.items() if name != "__metadata__"}
