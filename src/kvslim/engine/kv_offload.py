"""`BlockOffload`: the paged pool's side of the KV tier (kv_cache/tier.py). The block manager
calls it with a block id and its prefix-cache key: `save` copies the block's K/V (and scales)
out of the runner's cache tensors into the tier, `load` copies a stored block back into a
fresh block of the pool, checking its tokens and shapes first."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kvslim.kv_cache.tier import KVTier, StoredBlock


class BlockOffload:
    def __init__(self, runner, tier: KVTier, write_through: bool = False):
        self.runner, self.tier = runner, tier
        self.write_through = write_through

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.runner.kv_cache) + list(self.runner.kv_scales or [])

    def save(self, block_id: int, block_key: tuple[int, bytes], tokens: tuple[int, ...]) -> None:
        key = self.tier.key(block_key)
        if key not in self.tier:
            self.tier.put(key, StoredBlock(tuple(tokens), [
                t[:, block_id].to("cpu", copy=True) for t in self._tensors()]))

    def load(self, block_id: int, block_key: tuple[int, bytes], tokens: tuple[int, ...]) -> bool:
        stored = self.tier.get(self.tier.key(block_key))      # a miss is counted there
        if stored is None:
            return False
        targets = [t[:, block_id] for t in self._tensors()]
        if stored.tokens != tuple(tokens) or len(stored.tensors) != len(targets) or any(
                s.shape != t.shape or s.dtype != t.dtype for s, t in zip(stored.tensors, targets)):
            return False
        for target, source in zip(targets, stored.tensors):
            target.copy_(source)
        return True


def model_identity(model_dir: str | Path, kv_dtype, block_size: int, dtype) -> bytes:
    """What a stored block's contents depend on beyond its tokens: the model (its config and
    its weight files' names and sizes), the weights' and the cache's dtypes, the block size."""
    model_dir = Path(model_dir)
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.iterdir()
                     if p.suffix in (".safetensors", ".gguf", ".bin"))
    config = (model_dir / "config.json").read_bytes() if (model_dir / "config.json").is_file() \
        else b""
    text = json.dumps([weights, str(kv_dtype), block_size, str(dtype)]).encode()
    return hashlib.sha256(config + text).digest()
