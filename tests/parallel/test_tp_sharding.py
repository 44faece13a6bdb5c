"""Which heads, rows and vocabulary ids each tensor-parallel rank holds, the degrees refused,
and what `shard_model` refuses (no process group needed: shards are built in this process)."""
import pytest
import torch

from kvslim.errors import KvslimError
from kvslim.formats.loader import init_model
from kvslim.models.config import ModelConfig
from kvslim.parallel import (kv_head_layout, local_config, rank_layout, shard_model,
                             split_evenly, vocab_shard)

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2}


def heads(layout):
    return [(list(s.q_heads), list(s.kv_heads), s.kv_replicas) for s in layout]


def test_query_and_kv_heads_split_evenly():
    assert heads(kv_head_layout(8, 2, 2)) == [([0, 1, 2, 3], [0], 1), ([4, 5, 6, 7], [1], 1)]
    assert heads(kv_head_layout(8, 8, 4)) == [([0, 1], [0, 1], 1), ([2, 3], [2, 3], 1),
                                              ([4, 5], [4, 5], 1), ([6, 7], [6, 7], 1)]
    assert heads(kv_head_layout(8, 2, 1)) == [(list(range(8)), [0, 1], 1)]


def test_kv_heads_are_replicated_beyond_their_count():
    # rank r holds KV head r // (world_size // kv_heads): the one its query heads read
    assert heads(kv_head_layout(8, 2, 4)) == [([0, 1], [0], 2), ([2, 3], [0], 2),
                                              ([4, 5], [1], 2), ([6, 7], [1], 2)]
    mqa = kv_head_layout(8, 1, 8)
    assert [list(s.kv_heads) for s in mqa] == [[0]] * 8 and {s.kv_replicas for s in mqa} == {8}
    for n, k in ((4, 2), (8, 2), (8, 4), (2, 1)):
        group = 8 // k                   # query heads per KV head
        for s in kv_head_layout(8, k, n):
            assert {q // group for q in s.q_heads} == set(s.kv_heads)


@pytest.mark.parametrize("num_heads,kv_heads,n,message", [
    (4, 4, 3, "tensor_parallel_size 3 cannot split 4 query heads"),
    (12, 4, 6, "tensor_parallel_size 6 cannot split 4 KV heads: it must divide them or be a "
               "multiple of them"),
    (8, 2, 0, "tensor_parallel_size must be a positive integer, got 0"),
    (8, 2, True, "must be a positive integer"),
])
def test_degrees_that_cannot_split_the_heads(num_heads, kv_heads, n, message):
    with pytest.raises(KvslimError, match=message):
        kv_head_layout(num_heads, kv_heads, n)


@pytest.mark.parametrize("shape,quant,n,message", [
    ({}, {"quant_method": "gguf", "file": "m.gguf"}, 4,
     "tensor_parallel_size 4 gives each rank 16 inputs of the quantized o_proj \\(gguf\\), "
     "not a multiple of 32"),
    ({"hidden_size": 32}, {"quant_method": "gptq", "bits": 4, "group_size": 32}, 8,
     "tensor_parallel_size 8 gives each rank 4 inputs of the quantized o_proj \\(gptq\\), "
     "not a multiple of 8"),
])
def test_quantized_slices_off_their_packing_are_refused_before_loading(shape, quant, n, message):
    """8 query heads: GGUF's 32-input blocks split 8 heads of 8 two ways, not four; GPTQ's
    int32 words (8 values at 4 bits) split 8 heads of 4 four ways, not eight."""
    config = ModelConfig.from_hf_dict({**BASE, **shape, "quantization_config": quant})
    rank_layout(config, 0, n // 2)
    with pytest.raises(KvslimError, match=message):
        rank_layout(config, 0, n)


def test_intermediate_and_vocab():
    assert split_evenly(128, 4, "intermediate_size")[1] == range(32, 64)
    with pytest.raises(KvslimError, match="cannot split intermediate_size 100"):
        split_evenly(100, 8, "intermediate_size")
    # ceil(101 / 4) = 26 rows each; the last shard holds 23 ids and 3 zero rows
    shards = [vocab_shard(101, r, 4) for r in range(4)]
    assert [(s.start, s.stop, s.rows) for s in shards] == [(0, 26, 26), (26, 52, 26),
                                                           (52, 78, 26), (78, 101, 26)]
    assert [(s.start, s.stop) for s in (vocab_shard(5, r, 4) for r in range(4))] == \
        [(0, 2), (2, 4), (4, 5), (5, 5)]          # a rank may hold only padding


def test_per_layer_kv_heads_are_laid_out_layer_by_layer():
    config = ModelConfig.from_hf_dict({**BASE, "num_key_value_heads_per_layer": [4, 2, 1],
                                       "num_hidden_layers": 3})
    layout = rank_layout(config, 3, 4)
    assert [(s.num_heads, list(s.kv_heads), s.kv_replicas) for s in layout.heads] == \
        [(2, [3], 1), (2, [1], 2), (2, [0], 4)]
    assert layout.intermediate == range(96, 128)
    local = local_config(config, 2)
    assert local.num_attention_heads == 4 and local.kv_heads_per_layer == (2, 1, 1)
    assert local.intermediate_size == 64 and local.vocab_size == 101
    assert local_config(config, 1) is config


def test_moe_experts_and_unsplittable_models():
    mixtral = ModelConfig.from_hf_dict({**BASE, "architectures": ["MixtralForCausalLM"],
                                        "num_local_experts": 4, "num_experts_per_tok": 2})
    assert rank_layout(mixtral, 1, 2).expert_intermediate == range(64, 128)
    assert local_config(mixtral, 2).moe.expert_intermediate_size == 64
    with pytest.raises(KvslimError, match="cannot split intermediate_size 128"):
        rank_layout(ModelConfig.from_hf_dict({**BASE, "num_attention_heads": 3 * 8,
                                              "num_key_value_heads": 3 * 2,
                                              "head_dim": 8}), 0, 3)
    with pytest.raises(KvslimError, match="rank 2 is outside tensor_parallel_size 2"):
        rank_layout(mixtral, 2, 2)


def test_world_size_one_is_a_no_op():
    model = init_model(ModelConfig.from_hf_dict(BASE))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert shard_model(model, 0, 1) is model
    assert not hasattr(model, "tensor_parallel")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_shard_holds_its_slices():
    config = ModelConfig.from_hf_dict({**BASE, "attention_bias": True, "mlp_bias": True})
    full = init_model(config, seed=1)
    shard = shard_model(init_model(config, seed=1), 1, 2)
    attn, full_attn = shard.model.layers[0].self_attn, full.model.layers[0].self_attn
    d = config.head_dim
    q, k, v = full_attn.qkv_proj.shard_views(full_attn.qkv_proj.weight).values()
    sq, sk, sv = attn.qkv_proj.shard_views(attn.qkv_proj.weight).values()
    assert torch.equal(sq, q[4 * d:8 * d]) and torch.equal(sk, k[d:2 * d])
    assert torch.equal(sv, v[d:2 * d])
    assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, 4 * d:])
    assert torch.equal(attn.o_proj.bias, full_attn.o_proj.bias)     # whole, added once
    mlp, full_mlp = shard.model.layers[0].mlp, full.model.layers[0].mlp
    gate, up = full_mlp.gate_up_proj.shard_views(full_mlp.gate_up_proj.bias).values()
    assert torch.equal(mlp.gate_up_proj.bias, torch.cat([gate[64:], up[64:]]))
    assert torch.equal(mlp.down_proj.weight, full_mlp.down_proj.weight[:, 64:])
    embed = shard.model.embed_tokens.weight                  # ids 51..100 and one zero row
    assert torch.equal(embed[:50], full.model.embed_tokens.weight[51:])
    assert not embed[50].any()
    assert shard.config == local_config(config, 2)
    assert shard.tensor_parallel.full_config == config


@pytest.mark.parametrize("spoil,message", [
    ("prepared", "shard the model before prepare_for_inference"),
    ("sharded", "already a tensor-parallel shard"),
    ("unknown", "cannot split model.layers.0.extra \\(Linear\\)"),
])
def test_what_shard_model_refuses(spoil, message):
    model = init_model(ModelConfig.from_hf_dict(BASE))
    if spoil == "prepared":
        if not model.prepare_for_inference():
            pytest.skip("no packed CPU kernel here")
    elif spoil == "sharded":
        shard_model(model, 0, 2)
    else:
        model.model.layers[0].extra = torch.nn.Linear(64, 64)
    with pytest.raises(KvslimError, match=message):
        shard_model(model, 0, 2)
