"""`KVTier`: a second home for full prefix blocks, in host memory and on disk, so that a prefix
outlives its eviction from the paged pool and the process (vLLM's CPU offloading, SGLang's
HiCache, llama.cpp's --cache-ram and slot files).

A block is stored under a key that chains everything that shapes its contents: the model's
identity (its config and weight files), the KV dtype and block size, and the prefix cache's
own chained block hash (which already holds the tokens, a LoRA adapter and LongRoPE's
factors). Its tensors are one per cache tensor (K/V of each layer, and their scales for an int8
cache).

A file on disk is safe by construction: a header (magic, format version, the identity digest,
the key, the tokens, each tensor's dtype and shape), the payload, and a CRC-32 of both; it is
written under a temporary name, flushed, fsynced and renamed, so a crash mid-write leaves no
file that can be read, and several servers may share one directory. A file that does not
match (foreign model, torn, corrupted) is removed, never loaded. Both levels are bounded and
drop the least recently used block first; the memory level sits in front of the disk."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

MAGIC = b"KVSLIMKV"
VERSION = 1
SUFFIX = ".kvblock"


@dataclass
class TierStats:
    hits: int = 0              # blocks served from the tier
    misses: int = 0            # blocks looked up and not found
    bytes_read: int = 0
    bytes_written: int = 0
    load_s: float = 0.0
    rejected: int = 0          # files removed because they did not match


@dataclass
class StoredBlock:
    tokens: tuple[int, ...]
    tensors: list[torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass
class KVTier:
    identity: bytes                          # digest of what shapes a block's contents
    directory: Path | None = None
    max_disk_bytes: int | None = None
    memory_bytes: int = 0
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self):
        self.memory: OrderedDict[str, StoredBlock] = OrderedDict()
        self.memory_used = 0
        self.files: OrderedDict[str, int] = OrderedDict()        # key -> file size, LRU
        self.disk_used = 0                                       # their sizes summed
        if self.directory is not None:
            self.directory = Path(self.directory)
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()

    # ---- keys ----------------------------------------------------------------------------
    def key(self, block_key: tuple[int, bytes]) -> str:
        group, digest = block_key
        return hashlib.sha256(self.identity + group.to_bytes(4, "little") + digest).hexdigest()

    def __contains__(self, key: str) -> bool:
        if key in self.memory or key in self.files:
            return True
        # Another server sharing the directory may have written it since the scan.
        if self.directory is not None and self._path(key).is_file():
            self._index(key, self._path(key).stat().st_size)
            return True
        return False

    # ---- store and fetch -----------------------------------------------------------------
    def put(self, key: str, block: StoredBlock) -> None:
        if key in self:
            return
        if self.memory_bytes:
            self.memory[key] = block
            self.memory_used += block.num_bytes
            while self.memory_used > self.memory_bytes and self.memory:
                old_key, old = self.memory.popitem(last=False)
                self.memory_used -= old.num_bytes
                self._write(old_key, old)               # the disk level behind, if any
        else:
            self._write(key, block)

    def get(self, key: str) -> StoredBlock | None:
        start = time.perf_counter()
        block = self.memory.get(key)
        if block is not None:
            self.memory.move_to_end(key)
        elif key in self:                       # indexed, or written by a sharing server
            block = self._read(key)
        if block is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_read += block.num_bytes
        self.stats.load_s += time.perf_counter() - start
        return block

    # ---- the disk level ------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _scan(self) -> None:
        """Index the directory's block files, oldest use first (the shared directory may hold
        other models' blocks: they are found by key only, never loaded by mistake)."""
        found = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, path.name[:-len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._index(key, size)

    def _write(self, key: str, block: StoredBlock) -> None:
        if self.directory is None or key in self.files:
            return
        data = encode(self.identity, key, block)
        tmp = self.directory / f".{key}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path(key))
        self._index(key, len(data))
        self.stats.bytes_written += len(data)
        self._bound_disk()

    def _read(self, key: str) -> StoredBlock | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
            block = decode(self.identity, key, data)
        except FileNotFoundError:                # another server sharing it removed it
            self._unindex(key)
            return None
        except (OSError, ValueError):
            block = None
        if block is None:
            self._drop_file(key)
            self.stats.rejected += 1
            return None
        self.files.move_to_end(key)
        try:
            os.utime(path)                               # its use, for the next scan's order
        except FileNotFoundError:
            pass
        return block

    def _bound_disk(self) -> None:
        while (self.max_disk_bytes is not None and len(self.files) > 1
               and self.disk_used > self.max_disk_bytes):
            self._drop_file(next(iter(self.files)))

    def _index(self, key: str, size: int) -> None:
        self._unindex(key)
        self.files[key] = size
        self.disk_used += size

    def _unindex(self, key: str) -> None:
        self.disk_used -= self.files.pop(key, 0)

    def _drop_file(self, key: str) -> None:
        self._unindex(key)
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass


def encode(identity: bytes, key: str, block: StoredBlock) -> bytes:
    header = json.dumps({
        "version": VERSION, "identity": identity.hex(), "key": key, "tokens": list(block.tokens),
        "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in block.tensors],
    }).encode()
    payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                       for t in block.tensors)
    body = MAGIC + struct.pack("<I", len(header)) + header + payload
    return body + struct.pack("<I", zlib.crc32(body))


def decode(identity: bytes, key: str, data: bytes) -> StoredBlock | None:
    """The block a file holds, or None when it is not this key's block of this model (any
    field off, a short file, a bad checksum)."""
    if len(data) < len(MAGIC) + 8 or not data.startswith(MAGIC):
        return None
    body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
    if zlib.crc32(body) != crc:
        return None
    (size,) = struct.unpack("<I", body[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    header = json.loads(body[start:start + size])
    if (header.get("version") != VERSION or header.get("identity") != identity.hex()
            or header.get("key") != key):
        return None
    tensors, offset = [], start + size
    for dtype_name, shape in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        raw = bytearray(body[offset:offset + n])
        if len(raw) != n:
            return None
        tensors.append(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape))
        offset += n
    if offset != len(body):
        return None
    return StoredBlock(tuple(header["tokens"]), tensors)
