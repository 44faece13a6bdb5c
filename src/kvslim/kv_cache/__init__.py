"""The paged KV cache's sizing, below both the engine and the planner: which layers share a
block table (`groups.py`: KV-cache groups by attention window, and the block arithmetic of
windows) and `KVCachePlan` (`plan.py`: the dtype, the bytes of a block, how many blocks fit,
max_model_len, how many sequences fit at once), computed once and read by the CLI's checks, the
model runner, the draft model, tensor-parallel ranks and `kvslim memory`."""
from kvslim.kv_cache.groups import (NULL_BLOCK, KVCacheGroup, KVCacheGroups, blocks_held,
                                    first_needed_block, kv_cache_groups, longest_sequence,
                                    step_blocks)
from kvslim.kv_cache.plan import (DEFAULT_BLOCK_SIZE, ENGINE_KV_DTYPES, KVCachePlan,
                                  plan_kv_cache, size_kv_cache)

__all__ = ["DEFAULT_BLOCK_SIZE", "ENGINE_KV_DTYPES", "NULL_BLOCK", "KVCacheGroup",
           "KVCacheGroups", "KVCachePlan", "blocks_held", "first_needed_block",
           "kv_cache_groups", "longest_sequence", "plan_kv_cache", "size_kv_cache",
           "step_blocks"]
