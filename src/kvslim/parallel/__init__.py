"""Tensor parallelism (Megatron-style) on torch.distributed: the model-level groundwork.

N ranks each hold a slice of every decoder layer and run the model's ordinary forward in
lockstep on the same inputs; collectives inside the sharded layers make every rank's hidden
states and logits the full model's.

- `sharding`: which heads, intermediate rows and vocabulary rows rank r holds
  (`kv_head_layout`, `rank_layout`, `local_config`); pure arithmetic, and the one place the
  degrees that cannot split a model are refused (KvslimError naming the counts);
- `shard_model(model, rank, world_size, group=None)`: a loaded full model -> rank r's shard,
  in place (`model_shard.py` lists what each rank holds);
- `layers`: the sharded layers and their collectives (one all_reduce after o_proj, one after
  the MLP, one for the embeddings, one all_gather for the logits);
- `memory`: one rank's weight bytes and KV bytes per token at degree N, for the planner.

Using it (what the engine's worker processes will do):

    dist.init_process_group("nccl" or "gloo", rank=r, world_size=n, ...)
    model = shard_model(load_model(path, dtype, "cpu"), r, n).to(device)
    model.prepare_for_inference()
    hidden = model(input_ids, positions, attn)      # same inputs on every rank
    logits = model.compute_logits(hidden)           # full vocab, identical on every rank

The KV cache of rank r holds only its KV heads: size it from `model.config` (the shard's
`local_config`) as for any model."""
from kvslim.parallel.memory import RankMemory, rank_config, tensor_parallel_memory
from kvslim.parallel.model_shard import TensorParallelShard, shard_model
from kvslim.parallel.sharding import (HeadShard, RankLayout, VocabShard, kv_head_layout,
                                      local_config, rank_layout, split_evenly, vocab_shard)

__all__ = ["HeadShard", "RankLayout", "RankMemory", "TensorParallelShard", "VocabShard",
           "kv_head_layout", "local_config", "rank_config", "rank_layout", "shard_model",
           "split_evenly", "tensor_parallel_memory", "vocab_shard"]
