"""`shard_model`: turn a loaded full model into one tensor-parallel rank's shard, in place.

Every rank loads the same full model (`formats.loader.load_model`, on the CPU for a large one),
calls `shard_model(model, rank, world_size, group)` and moves the shard to its device; from then
on the model's own forward runs unchanged on every rank in lockstep (same inputs on every
rank, e.g. broadcast by the engine's driver), and every rank returns the same full hidden
states and logits. Per decoder layer that costs two all_reduces (after o_proj and after the
MLP), plus one for the embedding and one all_gather for the logits.

What a rank holds (`sharding.rank_layout`):

- attention: the q/k/v rows of its heads (its KV heads, or its one KV-head replica) in the
  fused `qkv_proj`, biases included; o_proj's columns of its query heads (`RowParallelLinear`).
  The Attention module's `num_heads` / `num_kv_heads` become the rank's; q/k norms and the
  scale are per head and stay whole;
- dense MLP: its slice of gate and up (rows of `gate_up_proj`), down_proj's matching columns;
- MoE (`SparseMoE`): the router whole, each expert sliced as the dense MLP but without a
  reduce per expert; the block's output is all-reduced once (`layers.reduce_output` hook);
- embeddings / LM head: its vocabulary block (`VocabParallelEmbedding`, `ParallelLMHead`);
  a tied head stays tied to the embedding shard;
- norms and RoPE: whole, on every rank.

Afterwards `model.config` is `sharding.local_config` (the rank's head and intermediate counts,
the full vocab_size), so what sizes itself from the config (the engine's KV cache) sizes the
rank's share; `model.tensor_parallel` (a `TensorParallelShard`) keeps the rank, the group, the
full config and the layout. Quantized layers (GPTQ/AWQ int4 and int8, W8A8, GGUF blocks and a
GGUF embedding table) are cut from their packed tensors by the same layout
(`parallel/quant_layers.py`). Not supported, refused with a KvslimError: MLA, shared experts, a
model whose kernels `prepare_for_inference` already chose (shard first, then prepare), and any
module with weights this file does not know how to split. world_size 1 returns the model
untouched: no collective, no process group needed."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.distributed as dist
from torch import nn

from kvslim.errors import KvslimError
from kvslim.layers.linear import Linear, MergedLinear, QKVLinear
from kvslim.layers.mlp import SwiGLUMLP
from kvslim.layers.moe import SparseMoE
from kvslim.layers.norm import NORMS
from kvslim.layers.self_attention import Attention
from kvslim.models.config import ModelConfig
from kvslim.parallel.layers import (ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                                    column_shard, merged_shard, reduce_output, row_shard)
from kvslim.parallel.quant_layers import (VocabParallelBlockEmbedding, quant_column_shard,
                                          quant_lm_head, quant_row_shard)
from kvslim.parallel.sharding import (HeadShard, RankLayout, check_world_size, local_config,
                                      rank_layout)
from kvslim.quantization import QuantLinear
from kvslim.quantization.gguf_blocks import BlockQuantLinear
from kvslim.quantization.gguf_embedding import BlockQuantEmbedding, TiedBlockQuantHead
from kvslim.quantization.registry import linear_classes


@dataclass
class TensorParallelShard:
    """What `shard_model` records on the shard as `model.tensor_parallel`."""
    rank: int
    world_size: int
    group: Any                         # the torch.distributed group (None: the default one)
    full_config: ModelConfig           # the unsharded model's config
    layout: RankLayout


def shard_model(model: nn.Module, rank: int, world_size: int, group=None) -> nn.Module:
    """Rank `rank` of `world_size`'s shard of `model` (a CausalLM or subclass), in
    place; returns the model. The process group need not exist yet (the collectives run only
    in forward), so shards can also be built and inspected in one process; when it does, its
    size and this process's rank in it must match."""
    check_world_size(world_size)
    if world_size == 1:
        return model
    config = model.config
    _check_shardable(model, config, rank, world_size, group)
    layout = rank_layout(config, rank, world_size)
    experts = set()
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_attention(module, layout.heads[module.layer_idx], group)
        elif isinstance(module, SparseMoE):
            for expert in module.experts:
                _shard_mlp(expert, layout.expert_intermediate, group, reduce=False)
                experts.add(id(expert))
            module.register_forward_hook(partial(reduce_output, group=group))
        elif isinstance(module, SwiGLUMLP) and id(module) not in experts:
            _shard_mlp(module, layout.intermediate, group)
    _shard_vocab(model, layout, config.vocab_size, group)
    model.config = local_config(config, world_size)
    model.tensor_parallel = TensorParallelShard(rank, world_size, group, config, layout)
    return model


def _shard_attention(attn: Attention, heads: HeadShard, group) -> None:
    d = attn.head_dim
    q = heads.q_heads
    columns = range(q.start * d, q.stop * d)
    if isinstance(attn.qkv_proj, QuantLinear):
        rows = {"q": heads.q_heads, "k": heads.kv_heads, "v": heads.kv_heads}
        attn.qkv_proj = quant_column_shard(attn.qkv_proj, {
            key: range(r.start * d, r.stop * d) for key, r in rows.items()})
        attn.o_proj = quant_row_shard(attn.o_proj, columns, group)
    else:
        attn.qkv_proj = column_shard(attn.qkv_proj, heads, d)
        attn.o_proj = RowParallelLinear.from_full(attn.o_proj, columns, group)
    attn.num_heads, attn.num_kv_heads = heads.num_heads, heads.num_kv_heads


def _shard_mlp(mlp: SwiGLUMLP, part: range, group, reduce: bool = True) -> None:
    """reduce=False for an expert: its down_proj returns a partial sum that the MoE block
    reduces once for all experts (an expert has no bias, `_check_shardable`)."""
    if isinstance(mlp.gate_up_proj, QuantLinear):          # experts are never quantized
        mlp.gate_up_proj = quant_column_shard(mlp.gate_up_proj,
                                              {key: part for key in mlp.gate_up_proj.shard_sizes})
        mlp.down_proj = quant_row_shard(mlp.down_proj, part, group)
    else:
        mlp.gate_up_proj = merged_shard(mlp.gate_up_proj, part)
        mlp.down_proj = (RowParallelLinear.from_full(mlp.down_proj, part, group) if reduce
                         else row_shard(mlp.down_proj, part))
    mlp.intermediate = len(part)


def _shard_vocab(model: nn.Module, layout: RankLayout, vocab_size: int, group) -> None:
    embed, head = model.model.embed_tokens, model.lm_head
    if isinstance(embed, BlockQuantEmbedding):
        model.model.embed_tokens = VocabParallelBlockEmbedding.from_full(embed, layout.vocab,
                                                                         group)
    else:
        model.model.embed_tokens = VocabParallelEmbedding.from_full(embed, layout.vocab, group)
    if isinstance(head, QuantLinear):
        model.lm_head = quant_lm_head(head, model.model.embed_tokens, layout.vocab, vocab_size,
                                      layout.world_size, group)
        return
    tied_to = model.model.embed_tokens.weight if head.weight is embed.weight else None
    model.lm_head = ParallelLMHead.from_full(head, layout.vocab, vocab_size,
                                             layout.world_size, group, tied_to)


# ---- what can be sharded -----------------------------------------------------------------------
_WHOLE = NORMS                            # replicated on every rank


def _check_shardable(model: nn.Module, config: ModelConfig, rank: int, world_size: int,
                     group) -> None:
    if hasattr(model, "tensor_parallel"):
        raise KvslimError("this model is already a tensor-parallel shard")
    if any(isinstance(m, Linear) and m.kernel is not None or
           isinstance(m, QuantLinear) and m.kernel is not None for m in model.modules()):
        raise KvslimError("shard the model before prepare_for_inference (its kernels hold the "
                          "full weights)")
    if dist.is_available() and dist.is_initialized():
        size, own = dist.get_world_size(group), dist.get_rank(group)
        if (size, own) != (world_size, rank):
            raise KvslimError(f"shard_model(rank={rank}, world_size={world_size}) does not match "
                              f"the process group (rank {own} of {size})")
    covered = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            _require(name, module, qkv_proj=_fused(module.qkv_proj, QKVLinear),
                     o_proj=_single(module.o_proj))
        elif isinstance(module, SparseMoE):
            _require(name, module, gate=(Linear,))
            for i, expert in enumerate(module.experts):
                _require(f"{name}.experts.{i}", expert, gate_up_proj=(MergedLinear,),
                         down_proj=(Linear,))
                if expert.down_proj.bias is not None:
                    raise KvslimError(f"{name}.experts.{i}: tensor parallelism of MoE experts "
                                      "with biases is not supported")
        elif isinstance(module, SwiGLUMLP):
            _require(name, module, gate_up_proj=_fused(module.gate_up_proj, MergedLinear),
                     down_proj=_single(module.down_proj))
        else:
            continue
        covered.append(name + ".")
    allowed = {"model.embed_tokens": (nn.Embedding, BlockQuantEmbedding),
               "lm_head": (Linear, BlockQuantLinear, TiedBlockQuantHead)}
    for name, module in model.named_modules():
        if not _holds_tensors(module) or isinstance(module, _WHOLE):
            continue
        if any(name.startswith(prefix) for prefix in covered):
            continue
        if name in allowed and type(module) in allowed[name]:
            continue
        raise KvslimError(f"tensor parallelism cannot split {name} ({type(module).__name__})")


def _holds_tensors(module: nn.Module) -> bool:
    """Parameters or persistent buffers (a quantized layer's weights; not RoPE's tables), or a
    head over another module's quantized table."""
    persistent = set(module._buffers) - module._non_persistent_buffers_set
    return (next(module.parameters(recurse=False), None) is not None or bool(persistent) or
            isinstance(module, TiedBlockQuantHead))


# The quantized layers `quant_layers` can cut, fused (q/k/v, gate/up) or single: every
# registered method's layer class.
def _fused(layer: nn.Module, float_cls: type) -> tuple[type, ...]:
    return linear_classes() if isinstance(layer, QuantLinear) else (float_cls,)


def _single(layer: nn.Module) -> tuple[type, ...]:
    return linear_classes() if isinstance(layer, QuantLinear) else (Linear,)


def _require(name: str, module: nn.Module, **children: tuple[type, ...]) -> None:
    """Each named child has exactly one of those types (a subclass may lay its weights out
    otherwise)."""
    for child, classes in children.items():
        found = getattr(module, child, None)
        if type(found) not in classes:
            raise KvslimError(f"tensor parallelism cannot split {name}.{child} "
                              f"({type(found).__name__})")
