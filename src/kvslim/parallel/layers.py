"""The layers of a tensor-parallel shard that talk to the other ranks, one collective each:

- `RowParallelLinear`: o_proj and the dense MLP's down_proj. Each rank holds the input columns
  of its heads (or intermediate slice) and computes a partial product; one all_reduce sums
  them. The bias is whole on every rank and added once, after the reduce.
- `VocabParallelEmbedding`: each rank holds a block of the vocabulary's rows; an id outside it
  looks up zeros, and one all_reduce assembles every token's row.
- `ParallelLMHead`: each rank computes its block's logits; one all_gather concatenates them
  along the vocabulary and the padding rows (`sharding.vocab_shard`) are cut off.
- `reduce_output`: a forward hook that all-reduces a whole MoE block's output once (its
  experts' down_proj are `row_shard`s returning partial sums, and their router-weighted sum is
  still one): one collective per layer, not one per expert.

Column-parallel layers (q/k/v, gate/up) need no collective: they are the ordinary fused
layers (`QKVLinear`, `MergedLinear`) at the shard's sizes, built by `column_shard` and
`merged_shard`. The row-parallel and head layers subclass `Linear`, so
`prepare_linears_for_inference` still gives them the packed CPU kernel, and parameter names stay
the checkpoint's (`o_proj.weight`, `o_proj.bias`, ...)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvslim.layers.linear import Linear, MergedLinear, QKVLinear
from kvslim.parallel.sharding import HeadShard, VocabShard

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _parameter(like: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter owning a copy of `data` (so the full tensor it was sliced from can be
    freed), with the original's requires_grad."""
    return nn.Parameter(data.contiguous().clone(), requires_grad=like.requires_grad)


def _on_meta(cls, *args, **kwargs):
    """The module built without allocating its parameters (they are assigned next)."""
    with torch.device("meta"):
        return cls(*args, **kwargs)


def column_shard(full: QKVLinear, heads: HeadShard, head_dim: int) -> QKVLinear:
    """The rows of `heads`' q, k and v in a fused QKV layer (weight and bias)."""
    rows = {"q": heads.q_heads, "k": heads.kv_heads, "v": heads.kv_heads}
    layer = _on_meta(QKVLinear, full.in_features, head_dim, heads.num_heads, heads.num_kv_heads,
                     full.bias is not None)
    _copy_blocks(layer, full, {k: range(r.start * head_dim, r.stop * head_dim)
                               for k, r in rows.items()})
    return layer


def merged_shard(full: MergedLinear, part: range) -> MergedLinear:
    """Rows `part` of every projection stacked in a merged layer (gate and up)."""
    layer = _on_meta(MergedLinear, full.in_features, tuple(full.shard_sizes), len(part),
                     full.bias is not None)
    _copy_blocks(layer, full, {key: part for key in full.shard_sizes})
    return layer


def _copy_blocks(layer, full, rows: dict) -> None:
    for leaf in ("weight", "bias"):
        tensor = getattr(full, leaf)
        if tensor is not None:
            views = full.shard_views(tensor)
            setattr(layer, leaf, _parameter(tensor, torch.cat(
                [views[key][r.start:r.stop] for key, r in rows.items()])))


def row_shard(full: Linear, columns: range) -> Linear:
    """Input columns `columns` of a layer without its bias: a partial product that the caller
    sums over the ranks (an MoE expert's down_proj, reduced once for the whole block)."""
    layer = _on_meta(Linear, len(columns), full.out_features, bias=False)
    layer.weight = _parameter(full.weight, full.weight[:, columns.start:columns.stop])
    return layer


class RowParallelLinear(Linear):
    """y = all_reduce(x_local @ W_local^T) + b over `group`; x_local is this rank's slice of
    the full layer's input (its heads' attention output, its intermediate slice)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group=None):
        super().__init__(in_features, out_features, bias)
        self.group = group

    @classmethod
    def from_full(cls, full: Linear, columns: range, group=None) -> "RowParallelLinear":
        layer = _on_meta(cls, len(columns), full.out_features, full.bias is not None, group)
        layer.weight = _parameter(full.weight, full.weight[:, columns.start:columns.stop])
        if full.bias is not None:
            layer.bias = _parameter(full.bias, full.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias

    @torch.no_grad()
    def prepare_for_inference(self, gemv_copy: bool, release_weight: bool) -> None:
        super().prepare_for_inference(gemv_copy, release_weight)
        self.kernel.bias = None        # the kernel makes the partial sum; bias after reduce


def vocab_rows(weight: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The shard's rows of a [vocab, hidden] table, zero rows appended up to `shard.rows` (for
    a GGUF block table too: codes, scales and mins of zero dequantize to a zero row)."""
    rows = weight[shard.start:shard.stop]
    pad = shard.rows - rows.shape[0]
    return rows if pad == 0 else torch.cat([rows, rows.new_zeros(pad, weight.shape[1])])


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, stop) of the token embeddings (zero-padded to `rows`); all_reduce over
    `group` adds the ranks' lookups, exactly one of which is not zero for each id."""

    def __init__(self, shard: VocabShard, weight: torch.Tensor, group=None):
        """weight: the shard's [rows, hidden] table, taken as the parameter (not copied)."""
        super().__init__(shard.rows, weight.shape[1], _weight=weight)
        self.start, self.stop, self.group = shard.start, shard.stop, group

    @classmethod
    def from_full(cls, full: nn.Embedding, shard: VocabShard, group=None
                  ) -> "VocabParallelEmbedding":
        layer = cls(shard, vocab_rows(full.weight, shard).contiguous().clone(), group)
        layer.weight.requires_grad_(full.weight.requires_grad)
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inside = (input_ids >= self.start) & (input_ids < self.stop)
        out = F.embedding(torch.where(inside, input_ids - self.start, 0), self.weight)
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class ParallelLMHead(Linear):
    """This rank's block of logits, all-gathered over `group` into the full [..., vocab_size]
    (the padding rows' logits dropped). Tied: `weight` is the embedding shard's parameter."""

    def __init__(self, in_features: int, shard: VocabShard, vocab_size: int, world_size: int,
                 group=None):
        super().__init__(in_features, shard.rows, bias=False)
        self.vocab_size, self.world_size, self.group = vocab_size, world_size, group

    @classmethod
    def from_full(cls, full: Linear, shard: VocabShard, vocab_size: int, world_size: int,
                  group=None, tied_to: nn.Parameter | None = None) -> "ParallelLMHead":
        layer = _on_meta(cls, full.in_features, shard, vocab_size, world_size, group)
        layer.weight = tied_to if tied_to is not None else _parameter(
            full.weight, vocab_rows(full.weight, shard))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_logits(super().forward(x), self.vocab_size, self.world_size, self.group)


def gather_logits(local: torch.Tensor, vocab_size: int, world_size: int, group=None
                  ) -> torch.Tensor:
    """Every rank's block of logits [..., rows] concatenated along the vocabulary, the padding
    rows cut off: [..., vocab_size]."""
    lead, rows = local.shape[:-1], local.shape[-1]
    local = local.reshape(-1, rows).contiguous()
    # the concatenated form ([N * tokens, rows]): gloo does not take the stacked one
    gathered = local.new_empty(world_size * local.shape[0], rows)
    _all_gather(gathered, local, group=group)
    logits = (gathered.view(world_size, -1, rows).permute(1, 0, 2)
              .reshape(*lead, world_size * rows))
    if logits.shape[-1] == vocab_size:
        return logits
    return logits[..., :vocab_size].contiguous()


def reduce_output(module: nn.Module, inputs, output: torch.Tensor, group=None) -> torch.Tensor:
    """Forward hook (bind `group` with functools.partial): the module's output, all-reduced."""
    dist.all_reduce(output, group=group)
    return output
