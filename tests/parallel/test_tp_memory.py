"""One tensor-parallel rank's memory: the planner's per-rank figures equal what the shard built
by `shard_model` really holds (its parameters; its attention modules' KV heads), and at degree 1
they are the single-device planner's."""
import pytest
import torch

from kvslim.formats.loader import init_model
from kvslim.models.config import ModelConfig
from kvslim.parallel import rank_config, shard_model, tensor_parallel_memory
from kvslim.plan.memory import plan_memory

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
        "rms_norm_eps": 1e-5}
CONFIGS = {
    "gqa": {**BASE, "num_key_value_heads": 2},
    "mqa": {**BASE, "num_key_value_heads": 1, "tie_word_embeddings": True},
    "mha": {**BASE, "num_key_value_heads": 8, "attention_bias": True, "mlp_bias": True},
    "per_layer": {**BASE, "num_key_value_heads_per_layer": [4, 1], "torch_dtype": "bfloat16"},
    "qwen2": {**BASE, "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 4},
    "gemma3": {**BASE, "architectures": ["Gemma3ForCausalLM"], "num_key_value_heads": 1,
               "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4,
               "layer_types": ["sliding_attention", "full_attention"]},
    "mixtral": {**BASE, "architectures": ["MixtralForCausalLM"], "num_key_value_heads": 2,
                "num_local_experts": 4, "num_experts_per_tok": 2},
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def held_bytes(model) -> int:
    """Bytes of the distinct parameters (a tied head counts once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}
               .values())


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_rank_memory_is_what_the_shard_holds(name, world_size):
    config = ModelConfig.from_hf_dict(CONFIGS[name])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.torch_dtype]
    mem = tensor_parallel_memory(config, world_size)
    for rank in range(world_size):
        shard = shard_model(init_model(config, dtype=dtype), rank, world_size)
        assert held_bytes(shard) == mem.weight_bytes
        attn = [layer.self_attn for layer in shard.model.layers]
        per_token = sum(a.num_kv_heads * a.head_dim * 2 * dtype.itemsize for a in attn)
        assert per_token == mem.kv_bytes_per_token
        # the engine sizes its cache from model.config: the shard's is the rank's
        assert shard.config.kv_cache_bytes_per_token(dtype) == per_token
        assert tuple(a.num_kv_heads for a in attn) == mem.kv_heads_per_layer


def test_replication_stops_shrinking_the_cache():
    config = ModelConfig.from_hf_dict(CONFIGS["gqa"])            # 2 KV heads
    per_rank = {n: tensor_parallel_memory(config, n, "fp16") for n in (1, 2, 4, 8)}
    kv = {n: m.kv_bytes_per_token for n, m in per_rank.items()}
    assert kv[1] == 2 * kv[2] and kv[2] == kv[4] == kv[8]        # 1 head per rank from N = 2
    assert per_rank[4].kv_replicas_per_layer == (2, 2) and per_rank[4].replicated
    assert not per_rank[2].replicated
    weights = [per_rank[n].weight_bytes for n in (1, 2, 4, 8)]
    assert weights == sorted(weights, reverse=True) and len(set(weights)) == 4


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8", "fp8"])
def test_degree_one_is_the_single_device_plan(kv_dtype):
    config = ModelConfig.from_hf_dict(CONFIGS["per_layer"])
    plan = plan_memory(config, kv_dtype=kv_dtype)
    mem = tensor_parallel_memory(config, 1, kv_dtype=kv_dtype)
    assert (mem.weight_bytes, mem.kv_bytes_per_token) == (plan.weight_bytes,
                                                          plan.kv_bytes_per_token)
    assert mem.weights_dtype == plan.weights_dtype == "bf16"
    # the planner run on one rank's shapes gives the same per-rank figures
    per_rank = plan_memory(rank_config(config, 4), kv_dtype=kv_dtype)
    mem4 = tensor_parallel_memory(config, 4, kv_dtype=kv_dtype)
    assert (per_rank.weight_bytes, per_rank.kv_bytes_per_token) == (mem4.weight_bytes,
                                                                    mem4.kv_bytes_per_token)
    scales = 2 * 2 * 2 if kv_dtype in ("int8", "fp8") else 0    # K+V, 2 layers, float16
    assert mem4.kv_bytes_per_token == 2 * 2 * 8 * (1 if scales else 2) + scales
