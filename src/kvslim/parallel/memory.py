"""Memory of one tensor-parallel rank: the weight bytes it holds and the KV-cache bytes it
stores per token, for a ModelConfig at degree N, counted exactly as `shard_model` lays it out
(`sharding.rank_layout`) so that the figures equal the shard's own tensors
(tests/parallel/test_tp_memory.py).

Both reuse the single-device formulas instead of re-deriving them: a rank's shapes are a
ModelConfig (`rank_config`: `local_config` with the vocabulary at one rank's padded block), and
`plan.parameters.parameter_counts` and `plan.memory.kv_bytes_per_token` (the engine's
elements + scales rule) price it as they price any model. Consequences worth knowing when reading the numbers:

- KV heads: a rank stores K/N heads per layer when N divides K, and one head when the heads
  are replicated (N > K), so N ranks together store max(K, N) heads: beyond N = K, adding ranks
  no longer shrinks a rank's cache (the weights keep shrinking);
- replicated on every rank: norms, the MoE router, the row-parallel layers' biases;
- the vocabulary is ceil(V/N) rows per rank (the padding rows are zeros but held).

`kvslim memory --tensor-parallel-size N` can call `tensor_parallel_memory` for the per-rank
figures, or run the whole planner on one rank with `plan_memory(rank_config(config, N), ...)`:
its capacity is then each rank's (every rank holds the same bytes)."""
from __future__ import annotations

from dataclasses import dataclass

from kvslim.models.config import ModelConfig
from kvslim.parallel.sharding import local_config, rank_layout
from kvslim.plan.memory import kv_bytes_per_token, parse_storage_dtype, storage_bytes
from kvslim.plan.parameters import parameter_counts


@dataclass(frozen=True)
class RankMemory:
    """One rank's share at `world_size` (every rank's is the same)."""
    world_size: int
    weights_dtype: str
    kv_dtype: str
    num_parameters: int                    # held by one rank, padding rows included
    weight_bytes: int
    kv_heads_per_layer: tuple[int, ...]    # stored by one rank
    kv_replicas_per_layer: tuple[int, ...]  # ranks storing each KV head (1: split, not copied)
    kv_bytes_per_token: int                # one rank, all layers, scales included (int8/fp8)

    @property
    def replicated(self) -> bool:
        return any(r > 1 for r in self.kv_replicas_per_layer)


def rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one rank holds, as a ModelConfig: `local_config` with vocab_size the rank's
    padded block of rows. For sizing only (a shard's `model.config` keeps the full vocab)."""
    rows = rank_layout(config, 0, world_size).vocab.rows
    local = local_config(config, world_size)
    return local if rows == local.vocab_size else local.replace(vocab_size=rows)


def tensor_parallel_memory(config: ModelConfig, world_size: int, dtype: str | None = None,
                           kv_dtype: str | None = None) -> RankMemory:
    """Per-rank weight and KV bytes. `dtype` and `kv_dtype` take the planner's names and
    defaults (`plan.memory.plan_memory`): the checkpoint's dtype, a float `dtype` for KV (else
    fp16). KvslimError when `world_size` cannot split the model."""
    dtype = parse_storage_dtype(dtype or config.torch_dtype, "--dtype")
    kv_dtype = parse_storage_dtype(
        kv_dtype or (dtype if dtype in ("fp32", "fp16", "bf16") else "fp16"), "--kv-dtype")
    shard = rank_config(config, world_size)
    total, _ = parameter_counts(shard)
    per_token = kv_bytes_per_token(shard, kv_dtype)
    heads = rank_layout(config, 0, world_size).heads
    return RankMemory(world_size, dtype, kv_dtype, total, storage_bytes(total, dtype),
                      shard.kv_heads_per_layer, tuple(h.kv_replicas for h in heads), per_token)
