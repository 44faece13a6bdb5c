"""`torch.ops.kvslim.write_slots(cache, slots, values)`: a paged KV cache's new tokens written
in place (csrc/store_slots.cpp), the CPU's cache write when the extension is built; a mutating
op, so a compiled step writes the cache in place too. Without the extension the cache writes
stay attention/kv_cache.py's `store_slots`."""
from __future__ import annotations

from kvslim.kernels import extension

FAKES = {"write_slots": lambda cache, slots, values: None}


def available() -> bool:
    return extension.ensure(FAKES)
