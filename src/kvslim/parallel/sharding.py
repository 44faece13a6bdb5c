"""Which slice of a model each tensor-parallel rank holds: pure arithmetic on the shapes, no
process group and no tensors, so the memory planner, the CLI and `shard_model` read the same
rule (and refuse the same degrees, with the same one-line message).

The rule, for `world_size` = N ranks (Megatron-style):

- query heads: split evenly, rank r holds heads [r*H/N, (r+1)*H/N); N must divide H;
- KV heads (per layer, so a non-uniform GQA model is laid out layer by layer):
  * N divides K: split evenly, rank r holds [r*K/N, (r+1)*K/N);
  * N > K and K divides N: each rank holds one replica, rank r holds head r // (N/K), the one
    its query heads attend to (rank r's H/N query heads all lie in that head's group);
  * anything else cannot be laid out: query heads of one rank would need KV heads of another;
- the (gated) MLP's intermediate size, and each MoE expert's: split evenly, N must divide it;
- the vocabulary: ceil(V/N) rows per rank, rank r holds ids [r*ceil(V/N), ...) up to V and the
  last shard is padded with zero rows. Every shard has the same shape, which is what
  `all_gather_single` needs for the LM head; the padded logits are dropped after the gather.
  Divisibility is not required (real vocabularies, e.g. 49152 or 151936, often are not).

Every rank's counts are the same (only *which* heads differ), so `local_config` is one
ModelConfig for all ranks: the engine can size its KV cache per rank from it unchanged."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds in one layer, as ranges of the full model's heads."""
    q_heads: range
    kv_heads: range
    kv_replicas: int = 1           # ranks holding each of these KV heads (1: not replicated)

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


@dataclass(frozen=True)
class VocabShard:
    """Token ids [start, stop) of the vocabulary; `rows` >= stop - start (zero-padded)."""
    start: int
    stop: int
    rows: int


@dataclass(frozen=True)
class RankLayout:
    """Everything rank `rank` of `world_size` holds of a model."""
    rank: int
    world_size: int
    heads: tuple[HeadShard, ...]           # one per layer
    intermediate: range                    # of the dense MLP; range(0) when every layer is MoE
    expert_intermediate: range | None      # of each MoE expert, when the model has experts
    vocab: VocabShard


def check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise KvslimError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")


def kv_head_layout(num_heads: int, num_kv_heads: int, world_size: int) -> tuple[HeadShard, ...]:
    """Per rank, the query and KV heads it holds (see the module docstring for the rule)."""
    check_world_size(world_size)
    n = world_size
    if num_heads % n:
        raise KvslimError(f"tensor_parallel_size {n} cannot split {num_heads} query heads: it "
                          "must divide num_attention_heads")
    if num_heads % num_kv_heads:
        raise KvslimError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    q = num_heads // n
    if num_kv_heads % n == 0:
        kv = num_kv_heads // n
        return tuple(HeadShard(range(r * q, (r + 1) * q), range(r * kv, (r + 1) * kv))
                     for r in range(n))
    if n % num_kv_heads == 0:
        replicas = n // num_kv_heads
        return tuple(HeadShard(range(r * q, (r + 1) * q),
                               range(r // replicas, r // replicas + 1), replicas)
                     for r in range(n))
    raise KvslimError(f"tensor_parallel_size {n} cannot split {num_kv_heads} KV heads: it must "
                      f"divide them or be a multiple of them ({num_heads} query heads)")


def split_evenly(size: int, world_size: int, what: str) -> tuple[range, ...]:
    """[0, size) in `world_size` equal consecutive ranges; `what` names `size` in the error."""
    check_world_size(world_size)
    if size % world_size:
        raise KvslimError(f"tensor_parallel_size {world_size} cannot split {what} {size}: it "
                          f"must divide it")
    part = size // world_size
    return tuple(range(r * part, (r + 1) * part) for r in range(world_size))


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> VocabShard:
    """Rank `rank`'s ids: ceil(V/N) rows each, the last shard(s) padded (module docstring)."""
    check_world_size(world_size)
    rows = -(-vocab_size // world_size)
    start = min(rank * rows, vocab_size)
    return VocabShard(start, min(start + rows, vocab_size), rows)


def _has_dense_mlp(config: ModelConfig) -> bool:
    return config.moe is None or config.moe.first_dense_layers > 0


def rank_layout(config: ModelConfig, rank: int, world_size: int) -> RankLayout:
    """What rank `rank` holds of `config`'s model; KvslimError if the degree cannot split it."""
    check_world_size(world_size)
    if not 0 <= rank < world_size:
        raise KvslimError(f"rank {rank} is outside tensor_parallel_size {world_size}")
    if config.mla is not None:
        raise KvslimError(f"tensor parallelism of {config.architecture}'s latent attention (MLA) "
                          "is not implemented")
    per_kv = {k: kv_head_layout(config.num_attention_heads, k, world_size)
              for k in set(config.kv_heads_per_layer)}
    heads = tuple(per_kv[k][rank] for k in config.kv_heads_per_layer)
    intermediate = (split_evenly(config.intermediate_size, world_size, "intermediate_size")[rank]
                    if _has_dense_mlp(config) else range(0))
    experts = None
    if config.moe is not None:
        if config.moe.num_shared_experts:
            raise KvslimError(f"tensor parallelism of shared MoE experts "
                              f"({config.architecture}) is not implemented")
        experts = split_evenly(config.moe.expert_intermediate_size, world_size,
                               "the experts' intermediate size")[rank]
    _check_quantized_slices(config, heads, intermediate, world_size)
    return RankLayout(rank, world_size, heads, intermediate, experts,
                      vocab_shard(config.vocab_size, rank, world_size))


# Inputs a row-parallel slice of a quantized layer must be a multiple of, as its method's layer
# says (`QuantLinear.input_multiple`): the int32 word a GPTQ layer packs along its inputs
# (32 / bits values), the 32-input block of GGUF's kernels; None for any.
def _row_slice_multiple(config: ModelConfig) -> int | None:
    quant = config.quantization
    multiple = 1 if quant is None else quant.input_multiple
    return None if multiple == 1 else multiple


def _check_quantized_slices(config: ModelConfig, heads, intermediate: range,
                            world_size: int) -> None:
    """o_proj's and down_proj's input slices of a quantized model must fall on its packing
    (parallel/quant_layers.py cuts the packed tensors, never a float copy)."""
    multiple = _row_slice_multiple(config)
    if multiple is None:
        return
    slices = {"o_proj": heads[0].num_heads * config.head_dim, "down_proj": len(intermediate)}
    for name, size in slices.items():
        if size % multiple:
            raise KvslimError(
                f"tensor_parallel_size {world_size} gives each rank {size} inputs of the "
                f"quantized {name} ({config.quantization.method}), not a multiple of {multiple}")


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: its query and KV heads per layer and its intermediate
    sizes (the same counts on every rank). vocab_size stays the full vocabulary, since the
    shard's logits are gathered back to it; a rank's embedding rows are `vocab_shard(...).rows`.
    `shard_model` sets this as the shard's `model.config`, so what reads a model's shapes from
    its config (the engine's KV cache, `kv_cache_bytes_per_token`) sees the rank's."""
    layout = rank_layout(config, 0, world_size)
    if world_size == 1:
        return config
    kv = tuple(h.num_kv_heads for h in layout.heads)
    changes = dict(num_attention_heads=layout.heads[0].num_heads, num_key_value_heads=max(kv),
                   layer_kv_heads=kv if config.layer_kv_heads is not None else None)
    if _has_dense_mlp(config):
        changes["intermediate_size"] = len(layout.intermediate)
    elif config.intermediate_size == config.moe.expert_intermediate_size:     # Mixtral's
        changes["intermediate_size"] = len(layout.expert_intermediate)
    if config.moe is not None:
        changes["moe"] = dataclasses.replace(
            config.moe, expert_intermediate_size=len(layout.expert_intermediate))
    return config.replace(**changes)


def replication_warning(num_heads: int, kv_heads_per_layer: tuple[int, ...] | list[int],
                        world_size: int) -> str | None:
    """What `kvslim convert` says when KV-head counts do not shard cleanly at `world_size`:
    replication (ranks beyond the KV heads each hold a copy, so a rank's cache stops shrinking)
    or a count that cannot be split at all; None when every layer splits its KV heads."""
    counts = sorted(set(kv_heads_per_layer))
    try:
        layouts = [kv_head_layout(num_heads, k, world_size) for k in counts]
    except KvslimError as e:
        return f"at --tensor-parallel-size {world_size} this model cannot run: {e}"
    replicated = [k for k, layout in zip(counts, layouts) if layout[0].kv_replicas > 1]
    if not replicated:
        return None
    k = replicated[0]
    return (f"at --tensor-parallel-size {world_size}, {k} KV head{'s' if k > 1 else ''} per "
            f"layer must be replicated: each of the {world_size} ranks stores one, "
            f"{world_size // k}x the cache of the {k} heads (ranks beyond {k} no longer shrink "
            f"a rank's KV cache); choose --kv-heads {world_size} or a multiple to split them")
