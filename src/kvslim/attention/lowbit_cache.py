"""The KV cache at 4 and 2 bits (`--kv-cache-dtype int4` / `int2`): KIVI's layout in the paged
pool, with each sequence's block still being filled kept in float16 beside it.

Keys are quantized per channel over a block's tokens, so a block can only be quantized once it
is full (kernels/lowbit_codes.py says the arithmetic). Until then its keys and values live in
the sequence's *recent* rows: float16, one block per block-table row (the block being filled;
with speculative decoding also the one before it, which a step may fill and then give back). This is KIVI's full-precision residual, bounded by one block.

What a query sees depends only on its own position, never on how the sequence was computed: a
query at position p reads every position before its residual (the blocks up to its own) from
the pool, dequantized, and the positions of its residual from the recent rows. So a
prompt computed in one chunk or in several, found in the prefix cache (whole blocks, already
quantized) or recomputed after a preemption gives the same bits, and so does its batch.

Per step (`RecentRows`, built once by the model runner and shared by every layer): each
sequence's recent rows of the block its first new token lands in, then its new tokens, gathered
into one float16 tensor that the decode kernel reads beside the pool; the blocks the step fills
are quantized from it before attention; the new tokens are kept as the sequence's recent rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.errors import KvslimError

# recent_blocks is kv_cache/plan.py's way to the rule (it may not import kernels itself)
from kvslim.kernels.lowbit_codes import (RESIDUAL_BLOCKS, hadamard, packed_width,  # noqa: F401
                                         quantize_key_blocks, quantize_value_blocks,
                                         recent_blocks, value_group)

RECENT_DTYPE = torch.float16


@dataclass
class RecentRows:
    """One step's indices into a packed cache (every layer the same): which recent rows and
    which new tokens make the step's recent tensor, where each token's own block starts in it,
    where each new token is kept, and the blocks the step fills."""
    size: int                     # rows of the step's recent tensor
    old_to: torch.Tensor          # its rows taken from the recent rows ...
    old_from: torch.Tensor        # ... these (rows of recent.view(-1, ..))
    new_to: torch.Tensor          # its rows taken from the step's new tokens, in order
    row_start: torch.Tensor       # [N] per new token: its own block's first row in that tensor
    keep_from: torch.Tensor       # [K] new tokens kept as recent rows (the last two blocks')
    keep_to: torch.Tensor         # [K] their rows in recent.view(-1, ..)
    fill_rows: torch.Tensor       # [F, block_size] rows of the step's tensor per filled block
    fill_blocks: torch.Tensor     # [F] the pool blocks they fill


def recent_rows(entries: list[tuple[int, int, int, list[int]]], block_size: int,
                num_rows: int, blocks: int, residual: int, device: torch.device) -> RecentRows:
    """entries: per sequence in step order (its tokens consecutive in the step), (its block-
    table row, first position, number of new tokens, its block table in this group); num_rows,
    blocks: the block-table rows the recent rows are allocated for, and blocks per row (a ring:
    block b in slot b % blocks); residual: the blocks a query reads from them, its own and the
    full ones before it. A block goes to the pool when it leaves every query's residual."""
    bs = block_size
    per_row = blocks * bs
    old_to, old_from, new_to, row_start, keep_from, keep_to = [], [], [], [], [], []
    fill_rows, fill_blocks = [], []
    token = offset = 0

    def first_float(p: int) -> int:                 # the first block position p reads in float
        return max(0, p // bs - residual + 1)

    for row, start, n, table in entries:
        end, first = start + n, first_float(start)
        earlier = start - first * bs
        old_to += range(offset, offset + earlier)
        old_from += [row * per_row + p // bs % blocks * bs + p % bs for p in range(first * bs, start)]
        new_to += range(offset + earlier, offset + earlier + n)
        row_start += [offset + (first_float(p) - first) * bs for p in range(start, end)]
        last_kept = max(start // bs, (end - 1) // bs - blocks + 1)
        for p in range(max(start, last_kept * bs), end):
            keep_from.append(token + p - start)
            keep_to.append(row * per_row + p // bs % blocks * bs + p % bs)
        for b in range(first, end // bs - residual + 1):   # its residual ends inside the step
            if (b + residual) * bs > start:
                rows = offset + (b - first) * bs
                fill_rows.append(list(range(rows, rows + bs)))
                fill_blocks.append(table[b])
        token += n
        offset += earlier + n

    def t(x, shape=None):
        out = torch.tensor(x, dtype=torch.long)
        return (out.view(shape) if shape else out).to(device)
    return RecentRows(offset, t(old_to), t(old_from), t(new_to), t(row_start), t(keep_from),
                      t(keep_to), t(fill_rows, (-1, bs)), t(fill_blocks))


class LowBitKVCacheLayer:
    """One layer's packed pool: codes [blocks, block_size, kvh, D*bits/8] for K and V, key
    params [blocks, kvh, 2, D] and value params [blocks, block_size, kvh, 2, D/g] (float16), and
    the recent rows [rows, blocks * block_size, kvh, D] for K and V. `rotation`: a
    Hadamard matrix K and V are rotated by before quantizing (and q with them; the output is
    rotated back), or None."""
    latent = False
    packed = True

    def __init__(self, codes: torch.Tensor, key_params: torch.Tensor, value_params: torch.Tensor,
                 recent: torch.Tensor, bits: int, rotation: torch.Tensor | None):
        self.k_codes, self.v_codes = codes[0], codes[1]
        self.key_params, self.value_params = key_params, value_params
        self.recent_k, self.recent_v = recent[0], recent[1]
        self.bits, self.rotation = bits, rotation
        self.residual = RESIDUAL_BLOCKS[bits]

    @classmethod
    def allocate(cls, blocks: int, block_size: int, kv_heads: int, head_dim: int, rows: int,
                 recent_blocks: int, bits: int, rotate: bool,
                 device: torch.device) -> "LowBitKVCacheLayer":
        width, groups = packed_width(head_dim, bits), head_dim // value_group(head_dim)
        return cls(torch.zeros(2, blocks, block_size, kv_heads, width, dtype=torch.uint8,
                               device=device),
                   torch.zeros(blocks, kv_heads, 2, head_dim, dtype=torch.float16, device=device),
                   torch.zeros(blocks, block_size, kv_heads, 2, groups, dtype=torch.float16,
                               device=device),
                   torch.zeros(2, rows, recent_blocks * block_size, kv_heads, head_dim,
                               dtype=RECENT_DTYPE, device=device),
                   bits, hadamard(head_dim, device) if rotate else None)

    def with_own_recent(self) -> "LowBitKVCacheLayer":
        """A layer on the same pool with recent rows of its own: the layers at one position of
        every KV-cache group share a pool (a block belongs to one group), but recent rows are
        kept by sequence row and position, which every group's layer has."""
        recent = (torch.zeros_like(self.recent_k), torch.zeros_like(self.recent_v))
        return LowBitKVCacheLayer((self.k_codes, self.v_codes), self.key_params,
                                  self.value_params, recent, self.bits, self.rotation)

    @property
    def block_size(self) -> int:
        return self.k_codes.shape[1]

    @property
    def recent_blocks(self) -> int:
        return self.recent_k.shape[1] // self.block_size

    @property
    def num_blocks(self) -> int:
        return self.k_codes.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k_codes.device

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it allocated (the runner's byte count)."""
        return [self.k_codes, self.v_codes, self.key_params, self.value_params, self.recent_k,
                self.recent_v]

    def block_bytes(self) -> int:
        """One block in the pool: its codes and parameters."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors()[:4])

    def write(self, recent: RecentRows, k: torch.Tensor, v: torch.Tensor):
        """The step's new k, v [N, KVH, D]: returns its recent keys and values [M, KVH, D]
        (float16) for the kernel, after quantizing the blocks the step fills into the pool and
        keeping the new tokens as recent rows."""
        if self.rotation is not None:
            k, v = k @ self.rotation, v @ self.rotation
        fresh = []
        for x, store in ((k, self.recent_k), (v, self.recent_v)):
            flat, x = store.view(-1, *store.shape[2:]), x.to(RECENT_DTYPE)
            rows = x.new_empty(recent.size, *x.shape[1:])
            rows.index_copy_(0, recent.old_to, flat.index_select(0, recent.old_from))
            rows.index_copy_(0, recent.new_to, x)
            fresh.append(rows)
            flat.index_copy_(0, recent.keep_to, x.index_select(0, recent.keep_from))
        if recent.fill_blocks.numel():
            self._fill(recent, *fresh)
        return fresh[0], fresh[1]

    def _fill(self, recent: RecentRows, keys: torch.Tensor, values: torch.Tensor) -> None:
        blocks = recent.fill_blocks
        codes, params = quantize_key_blocks(keys[recent.fill_rows], self.bits)
        self.k_codes.index_copy_(0, blocks, codes)
        self.key_params.index_copy_(0, blocks, params)
        codes, params = quantize_value_blocks(values[recent.fill_rows], self.bits)
        self.v_codes.index_copy_(0, blocks, codes)
        self.value_params.index_copy_(0, blocks, params)


def check_packed_cache(backend: str, config, model_config) -> None:
    """What a 4-/2-bit cache runs with, or a one-line error: kvslim's
    CPU decode kernel (a float32 model), chains of speculative tokens that fit in a block, a
    power-of-two head_dim for the Hadamard rotation."""
    name = config.kv_cache_dtype
    if backend != "kernel":
        raise KvslimError(f"kv_cache_dtype={name} runs on kvslim's CPU decode kernel: a float32 "
                          f"model on the CPU with attention_backend auto or kernel")
    spec = config.speculative
    if spec is not None and (spec.tree is not None or
                             spec.num_speculative_tokens + 1 > config.block_size):
        raise KvslimError(f"kv_cache_dtype={name} verifies chains of drafts no longer than a "
                          f"block less one token ({config.block_size - 1}), not trees")
    d = model_config.head_dim
    if config.kv_hadamard and d & (d - 1):
        raise KvslimError(f"kv_hadamard needs a power-of-two head_dim, this model has {d}")
