"""Reading a GGUF file (llama.cpp's format): open it with a clear error when it is not one, read
its metadata by key, and dequantize its tensors to float32 in PyTorch's row-major layout."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvslim.errors import ConfigError

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFFile:
    path: Path
    reader: Any                      # header.FastGGUFReader; loosely typed: gguf loads lazily

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"GGUF file not found: {path}")
        with path.open("rb") as f:
            magic = f.read(4)
        # Checked here because GGUFReader's own error for a wrong file is a bare ValueError.
        if magic != GGUF_MAGIC:
            raise ConfigError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        from kvslim.formats.gguf.header import FastGGUFReader
        try:
            reader = FastGGUFReader(path)
        except (ValueError, OSError, IndexError, KeyError) as e:
            raise ConfigError(f"{path} is not a readable GGUF file: {e}") from None
        return cls(path, reader)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python data (str, int, float, bool or list), or `default`."""
        return self.reader.values.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.path.name}: GGUF metadata has no {key!r}")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    @property
    def tensors(self) -> list[Any]:
        return list(self.reader.tensors)


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor. GGUF lists dimensions fastest-first, so the
    PyTorch shape is the reverse of `tensor.shape`."""
    from gguf.quants import dequantize
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ConfigError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                          "which the gguf package cannot dequantize") from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # np.array copies: F32 data is a read-only view of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
