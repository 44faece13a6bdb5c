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
full config and the layout. Not supported, refused with a KvslimError: quantized models (the
packed int4/GGUF/W8A8 layouts would each need their own slicing rule), MLA, shared experts, a
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
from kvslim.layers.norm import GemmaRMSNorm, RMSNorm
from kvslim.layers.self_attention import Attention
from kvslim.models.config import ModelConfig
from kvslim.parallel.layers import (ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
                                    column_shard, merged_shard, reduce_output, row_shard)
from kvslim.parallel.sharding import (HeadShard, RankLayout, check_world_size, local_config,
                                      rank_layout)


@dataclass
class TensorParallelShard:
    """What `shard_model` records on the shard as `model.tensor_parallel`."""
    rank: int
    world_size: int
    group: Any                         # the torch.distributed group (None: the default one)
    full_config: ModelConfig           # the unsharded model's config
    layout: RankLayout


def shard_model(model: nn.Module, rank: int, world_size: int, group=None) -> nn.Module:
    """Rank `rank` of `world_size`'s shard of `model` (a LlamaForCausalLM or subclass), in
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
    attn.qkv_proj = column_shard(attn.qkv_proj, heads, d)
    q = heads.q_heads
    attn.o_proj = RowParallelLinear.from_full(attn.o_proj, range(q.start * d, q.stop * d), group)
    attn.num_heads, attn.num_kv_heads = heads.num_heads, heads.num_kv_heads


def _shard_mlp(mlp: SwiGLUMLP, part: range, group, reduce: bool = True) -> None:
    """reduce=False for an expert: its down_proj returns a partial sum that the MoE block
    reduces once for all experts (an expert has no bias, `_check_shardable`)."""
    mlp.gate_up_proj = merged_shard(mlp.gate_up_proj, part)
    mlp.down_proj = (RowParallelLinear.from_full(mlp.down_proj, part, group) if reduce
                     else row_shard(mlp.down_proj, part))
    mlp.intermediate = len(part)


def _shard_vocab(model: nn.Module, layout: RankLayout, vocab_size: int, group) -> None:
    embed = model.model.embed_tokens
    tied = model.lm_head.weight is embed.weight
    model.model.embed_tokens = VocabParallelEmbedding.from_full(embed, layout.vocab, group)
    tied_to = model.model.embed_tokens.weight if tied else None
    model.lm_head = ParallelLMHead.from_full(model.lm_head, layout.vocab, vocab_size,
                                             layout.world_size, group, tied_to)


# ---- what can be sharded -----------------------------------------------------------------------
_WHOLE = (RMSNorm, GemmaRMSNorm)          # replicated on every rank


def _check_shardable(model: nn.Module, config: ModelConfig, rank: int, world_size: int,
                     group) -> None:
    if config.quantization is not None:
        raise KvslimError(f"tensor parallelism of quantized models "
                          f"({config.quantization.method}) is not supported yet")
    if hasattr(model, "tensor_parallel"):
        raise KvslimError("this model is already a tensor-parallel shard")
    if any(isinstance(m, Linear) and m.cpu_kernel is not None for m in model.modules()):
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
            _require(name, module, qkv_proj=QKVLinear, o_proj=Linear)
        elif isinstance(module, SparseMoE):
            _require(name, module, gate=Linear)
            for i, expert in enumerate(module.experts):
                _require(f"{name}.experts.{i}", expert, gate_up_proj=MergedLinear,
                         down_proj=Linear)
                if expert.down_proj.bias is not None:
                    raise KvslimError(f"{name}.experts.{i}: tensor parallelism of MoE experts "
                                      "with biases is not supported")
        elif isinstance(module, SwiGLUMLP):
            _require(name, module, gate_up_proj=MergedLinear, down_proj=Linear)
        else:
            continue
        covered.append(name + ".")
    allowed = {"model.embed_tokens": nn.Embedding, "lm_head": Linear}
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None or isinstance(module, _WHOLE):
            continue
        if any(name.startswith(prefix) for prefix in covered):
            continue
        if name in allowed and type(module) is allowed[name]:
            continue
        raise KvslimError(f"tensor parallelism cannot split {name} ({type(module).__name__})")


def _require(name: str, module: nn.Module, **children: type) -> None:
    """Each named child has exactly that type (a subclass may lay its weights out otherwise)."""
    for child, cls in children.items():
        found = getattr(module, child, None)
        if type(found) is not cls:
            raise KvslimError(f"tensor parallelism cannot split {name}.{child} "
                              f"({type(found).__name__})")
