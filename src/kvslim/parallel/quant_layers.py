"""Tensor-parallel shards of quantized layers, cut from the packed tensors themselves: a rank
holds its slice of the int4/int8 codes, scales and zero points as the checkpoint stores them,
never a float copy (what the full layer's kernel choice then runs on the slice, see
`QuantLinear.prepare_for_inference`).

Two layouts, one rule each (`QuantLinear.ROW_MAJOR`; quantization/gptq.py, w8a8.py,
gguf_blocks.py):

- GPTQ (`GPTQLinear`, also AWQ and compressed-tensors int4, converted to it at load): column
  major, `qweight` [in/pack, out], `qzeros` [groups, out/pack], `scales` [groups, out],
  `g_idx` [shards, in]. Column-parallel keeps output columns (the packed zero points unpacked,
  cut, repacked); row-parallel keeps input rows (the packed codes likewise) with their g_idx,
  and only the groups those rows use, renumbered from 0 — under act-order they may be all of
  them, which is still exact;
- row major (`BlockQuantLinear` for GGUF blocks, `W8A8Linear`): every tensor [out, ...], so
  column-parallel keeps rows; row-parallel keeps input columns, for GGUF blocks only at a
  32-input boundary (the int4 kernel's group; one-line error otherwise).

Row-parallel shards drop their bias (a forward hook all-reduces the partial product and adds
the bias once, `_reduce_and_add_bias`). A W8A8 row shard also agrees with the other ranks on
each token's activation scale (one MAX all_reduce of the rows' largest magnitudes), so every
rank quantizes its slice of the activations exactly as the full layer quantizes the whole row
(`RowParallelW8A8Linear`): without it each rank would pick its own scale and the sum would
not be the full layer's product. GGUF token embeddings (and a tied or quantized LM head) are
cut by vocabulary rows like the float ones (`VocabParallelBlockEmbedding`, `gather_logits`)."""
from __future__ import annotations

from functools import partial
from typing import Hashable

import torch
import torch.distributed as dist
from torch import nn

from kvslim.errors import KvslimError
from kvslim.parallel.layers import vocab_rows, gather_logits
from kvslim.parallel.sharding import VocabShard
from kvslim.quantization import QuantLinear
from kvslim.quantization.gguf_blocks import GROUP, INT4_GROUP, BlockQuantLinear
from kvslim.quantization.gguf_embedding import BlockQuantEmbedding, TiedBlockQuantHead
from kvslim.quantization.gptq import pack_int32, unpack_int32
from kvslim.quantization.kernels import pack_w8a8, w8a8_linear
from kvslim.quantization.w8a8 import W8A8Linear


def _empty_like(full: QuantLinear, in_features: int, shard_sizes: dict, bias: bool,
                cls: type | None = None) -> QuantLinear:
    """A layer of `full`'s kind (or `cls`) at these sizes, its buffers on the meta device (the
    shard's tensors are assigned next)."""
    cls = cls or type(full)
    with torch.device("meta"):
        return cls(in_features, 0, bias, full.spec, shard_sizes)


def _assign(layer: nn.Module, leaf: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    tensor = tensor.contiguous().clone()
    if isinstance(like, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=like.requires_grad)
    setattr(layer, leaf, tensor)


# ---- column-parallel: q/k/v, gate/up -----------------------------------------------------------
def quant_column_shard(full: QuantLinear, rows: dict[Hashable, range]) -> QuantLinear:
    """The output rows `rows[key]` (within each shard `key`) of a quantized fused layer."""
    keys = list(full.shard_sizes)
    layer = _empty_like(full, full.in_features, {k: len(rows[k]) for k in keys},
                        full.bias is not None)
    for leaf in full.LEAVES:
        tensor = getattr(full, leaf)
        if tensor is None:
            continue
        parts = [_output_part(full, leaf, key, rows[key]) for key in keys]
        dim = 1 if leaf in ("qweight", "qzeros", "scales") and not full.ROW_MAJOR else 0
        _assign(layer, leaf, torch.cat(parts, dim=dim), tensor)
    return layer


def _output_part(full: QuantLinear, leaf: str, key: Hashable, part: range) -> torch.Tensor:
    view = full.shard_view(leaf, key)
    if leaf == "g_idx":                   # one row per shard, over the inputs: kept whole
        return view.unsqueeze(0)
    if leaf == "qtype":                   # one GGML type per shard
        return view
    if full.ROW_MAJOR or leaf == "bias":
        return view[part.start:part.stop]
    if leaf == "qzeros":
        bits = full.spec.bits
        return pack_int32(unpack_int32(view, bits, 1)[:, part.start:part.stop], bits, 1)
    return view[:, part.start:part.stop]


# ---- row-parallel: o_proj, down_proj ----------------------------------------------------------
def quant_row_shard(full: QuantLinear, columns: range, group=None) -> QuantLinear:
    """The input columns `columns` of a quantized layer, summed over the ranks by a forward
    hook that then adds the full bias once."""
    if isinstance(full, BlockQuantLinear) and (columns.start % INT4_GROUP or
                                               len(columns) % INT4_GROUP):
        raise KvslimError(f"tensor parallelism cannot split a GGUF block layer of "
                          f"{full.in_features} inputs at [{columns.start}, {columns.stop}): "
                          f"the slices must be multiples of {INT4_GROUP} inputs")
    if not full.ROW_MAJOR and (
            columns.start % full.spec.pack or len(columns) % full.spec.pack):
        raise KvslimError(f"tensor parallelism cannot split a {full.spec.bits}-bit GPTQ layer "
                          f"at [{columns.start}, {columns.stop}): the slices must be multiples "
                          f"of {full.spec.pack} inputs")
    cls = RowParallelW8A8Linear if isinstance(full, W8A8Linear) else type(full)
    layer = _empty_like(full, len(columns), full.shard_sizes, False, cls)
    cut = _row_major_columns if full.ROW_MAJOR else _gptq_rows
    for leaf, tensor in cut(full, columns).items():
        _assign(layer, leaf, tensor, getattr(full, leaf))
    if isinstance(layer, RowParallelW8A8Linear):
        layer.group = group
    if full.bias is not None:
        layer.register_buffer("reduced_bias", full.bias.detach().clone())
    layer.register_forward_hook(partial(_reduce_and_add_bias, group=group))
    return layer


def _row_major_columns(full: QuantLinear, columns: range) -> dict[str, torch.Tensor]:
    c = slice(columns.start, columns.stop)
    if isinstance(full, W8A8Linear):              # one scale per output row: whole
        return {"weight": full.weight[:, c], "weight_scale": full.weight_scale}
    g = slice(columns.start // GROUP, columns.stop // GROUP)
    return {"qvalues": full.qvalues[:, c], "scales": full.scales[:, g], "mins": full.mins[:, g],
            "qtype": full.qtype}


def _gptq_rows(full: QuantLinear, columns: range) -> dict[str, torch.Tensor]:
    bits = full.spec.bits
    codes = unpack_int32(full.qweight, bits, 0)[columns.start:columns.stop]
    g_idx = full.g_idx[:, columns.start:columns.stop].long()
    first, last = int(g_idx.min()), int(g_idx.max()) + 1        # the groups these rows use
    return {"qweight": pack_int32(codes, bits, 0), "qzeros": full.qzeros[first:last],
            "scales": full.scales[first:last], "g_idx": (g_idx - first).to(torch.int32)}


def _reduce_and_add_bias(module: nn.Module, inputs, output: torch.Tensor, group=None
                         ) -> torch.Tensor:
    dist.all_reduce(output, group=group)
    bias = getattr(module, "reduced_bias", None)
    return output if bias is None else output + bias.to(output.dtype)


class RowParallelW8A8Linear(W8A8Linear):
    """A W8A8 row shard whose per-token activation scale is the full row's: the ranks' largest
    magnitudes are all-reduced (MAX) before quantizing, so each rank's int8 activations are
    exactly the full layer's on its columns and the reduced sum is its product."""
    group = None
    packed = None       # prepare_for_inference's kernel weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.reshape(-1, self.in_features).float().abs().amax(dim=-1, keepdim=True)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return w8a8_linear(x, self.weight, self.weight_scale.view(-1), None, amax, self.packed)

    @torch.no_grad()
    def prepare_for_inference(self) -> None:
        self.weight = self.weight.contiguous()   # forward is already the integer product
        self.packed = pack_w8a8(self.weight, self.weight_scale.view(-1))


# ---- vocabulary-parallel: GGUF token embeddings and LM heads -----------------------------------
class VocabParallelBlockEmbedding(BlockQuantEmbedding):
    """Rows [start, stop) of a GGUF block embedding table (zero-padded to `rows`); ids outside
    look up zeros and one all_reduce assembles every token's row, as VocabParallelEmbedding."""

    @classmethod
    def from_full(cls, full: BlockQuantEmbedding, shard: VocabShard, group=None
                  ) -> "VocabParallelBlockEmbedding":
        layer = cls.__new__(cls)
        with torch.device("meta"):
            BlockQuantEmbedding.__init__(layer, shard.rows, full.embedding_dim)
        for leaf in ("qvalues", "scales", "mins"):
            setattr(layer, leaf, vocab_rows(getattr(full, leaf), shard).contiguous().clone())
        layer.qtype = full.qtype.clone()
        layer.start, layer.stop, layer.group = shard.start, shard.stop, group
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inside = (input_ids >= self.start) & (input_ids < self.stop)
        out = super().forward(torch.where(inside, input_ids - self.start, 0))
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


def quant_lm_head(full: nn.Module, embed: nn.Module, shard: VocabShard, vocab_size: int,
                  world_size: int, group=None) -> nn.Module:
    """A quantized LM head's vocabulary block, its logits all-gathered by a forward hook: tied
    to the (sharded) GGUF embedding table, or its own GGUF blocks' rows."""
    if isinstance(full, TiedBlockQuantHead):
        head = TiedBlockQuantHead(embed, full.spec)
    elif isinstance(full, BlockQuantLinear):
        head = _empty_like(full, full.in_features, {None: shard.rows}, False)
        for leaf in ("qvalues", "scales", "mins"):
            _assign(head, leaf, vocab_rows(getattr(full, leaf), shard), getattr(full, leaf))
        head.qtype = full.qtype.clone()
    else:
        raise KvslimError(f"tensor parallelism cannot split lm_head ({type(full).__name__})")
    head.register_forward_hook(partial(_gather_hook, vocab_size=vocab_size,
                                       world_size=world_size, group=group))
    return head


def _gather_hook(module, inputs, output, vocab_size: int, world_size: int, group=None):
    return gather_logits(output, vocab_size, world_size, group)
