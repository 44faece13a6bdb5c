"""`EngineConfig`: everything that shapes the engine, validated once."""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvslim.attention.backends import check_attention_backend
from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.errors import KvslimError
from kvslim.parallel.sharding import check_world_size

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12,
          "tb": 10**12}


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', 1048576 -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise KvslimError(f"cannot parse memory size {value!r}; use e.g. 512MiB, 2GiB or 1.5GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    kv_cache_memory: int = 1 << 30       # bytes for K and V of all layers
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024   # tokens computed per step, prefill chunks included
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"         # auto (the model's dtype), int8 or fp8_e4m3
    device: str = "auto"
    seed: int = 0                        # for requests that sample without their own seed
    enforce_eager: bool = False          # on CUDA: no CUDA graphs for decode steps
    # Paged attention: "gather" (each context copied out, the reference), "flex" (FlexAttention
    # reading the cache in place) or "auto" (attention/backends.py: flex on CUDA, the measured
    # faster one on the CPU). A quantized KV cache always gathers.
    attention_backend: str = "auto"
    # Sliding-window layers keep every block (their windows only mask), instead of releasing
    # the blocks that fell out of the window: the mask-only path, for comparison.
    keep_out_of_window_blocks: bool = False
    # Speculative decoding: a SpeculativeConfig or a dict of its options; None: off.
    speculative: SpeculativeConfig | dict | None = None
    # Tensor parallelism (`engine/parallel_executor.py`): ranks that each hold a slice of the
    # model and its own share of the KV cache (kv_cache_memory is per rank).
    tensor_parallel_size: int = 1
    # Start more ranks on this machine than it has CPU cores: each rank then competes for a
    # core, which only tests and experiments want (CUDA ranks always need a device each).
    tensor_parallel_oversubscribe: bool = False
    # Seconds a rank waits in a collective of the model's forward before giving up (a rank that
    # hangs fails the engine instead of stalling it forever); also the rendezvous' limit.
    distributed_timeout: float = 60.0

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.speculative = SpeculativeConfig.from_value(self.speculative)
        for name in ("kv_cache_memory", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise KvslimError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise KvslimError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        check_attention_backend(self.attention_backend)
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise KvslimError(f"max_model_len must be positive, got {self.max_model_len}")
        self._check_parallel()

    def _check_parallel(self) -> None:
        check_world_size(self.tensor_parallel_size)
        if not self.distributed_timeout > 0:
            raise KvslimError(f"distributed_timeout must be positive seconds, got "
                              f"{self.distributed_timeout!r}")
        if self.tensor_parallel_size > 1 and self.speculative is not None:
            raise KvslimError("speculative decoding with tensor_parallel_size > 1 is not "
                              "supported yet")


def num_kv_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Blocks that kv_cache_memory holds; at least one must fit. Used both before a model loads
    (the CLI, from config.json) and by the model runner."""
    num_blocks = config.kv_cache_memory // bytes_per_block
    if num_blocks < 1:
        raise KvslimError(
            f"kv_cache_memory={config.kv_cache_memory} bytes is too small for one block of "
            f"{config.block_size} tokens ({bytes_per_block} bytes for this model)")
    return num_blocks
