"""ModelConfig: the one KV formula, and DeepSeek's MLA and MoE shapes (the planner's latent cache)."""
import pytest

from kvslim.errors import ConfigError
from kvslim.models.config import ModelConfig
from kvslim.plan.published import PUBLISHED_CONFIGS

MIXTRAL = PUBLISHED_CONFIGS["Mixtral-8x7B"][1]
DEEPSEEK = PUBLISHED_CONFIGS["DeepSeek-V2"][1]


def test_kv_bytes_per_token_is_two_layers_kv_heads_head_dim_bytes():
    config = ModelConfig.from_hf_dict(PUBLISHED_CONFIGS["Llama-2-70B"][1])
    assert config.kv_elements_per_token() == 2 * 80 * 8 * 128
    assert config.kv_bytes_per_token("float16") == 2 * 80 * 8 * 128 * 2
    assert config.kv_bytes_per_token("float32") == 2 * 80 * 8 * 128 * 4
    assert config.kv_elements_per_token(64) == 2 * 80 * 64 * 128       # its MHA equivalent
    assert config.runnable and config.moe is None and config.mla is None


def test_mixtral_and_deepseek_run():
    assert ModelConfig.from_hf_dict(MIXTRAL).runnable          # the engine runs its MoE
    assert ModelConfig.from_hf_dict(DEEPSEEK).runnable         # and DeepSeek's MLA


def test_deepseek_reads_the_same_for_the_planner():
    """The planner's reading (runnable=False) and the engine's are one config."""
    assert ModelConfig.from_hf_dict(DEEPSEEK, runnable=False) == ModelConfig.from_hf_dict(DEEPSEEK)


def test_unknown_architectures_are_not_runnable():
    cfg = {**MIXTRAL, "architectures": ["FalconForCausalLM"]}
    with pytest.raises(ConfigError, match="unsupported architecture 'FalconForCausalLM'"):
        ModelConfig.from_hf_dict(cfg)


def test_moe_and_mla_shapes():
    mixtral = ModelConfig.from_hf_dict(MIXTRAL, runnable=False)
    assert (mixtral.moe.num_experts, mixtral.moe.num_experts_per_tok) == (8, 2)
    deepseek = ModelConfig.from_hf_dict(DEEPSEEK, runnable=False)
    assert deepseek.attention_kind == "MLA"
    assert (deepseek.head_dim, deepseek.v_head_dim) == (128 + 64, 128)
    assert deepseek.kv_elements_per_token() == 60 * (512 + 64)        # latent + RoPE key
    assert deepseek.kv_elements_per_token(1) == 60 * 1 * (192 + 128)  # its MQA equivalent
    assert deepseek.moe.num_shared_experts == 2 and deepseek.moe.first_dense_layers == 1


def test_name_and_source_take_no_part_in_equality(tmp_path):
    cfg = PUBLISHED_CONFIGS["SmolLM2-135M"][1]
    named = ModelConfig.from_hf_dict(cfg, name="a", source="b")
    assert named == ModelConfig.from_hf_dict(cfg) and named.replace().name == "a"


PHI3 = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.mark.parametrize("extra,message", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "longrope rope_scaling needs original_max_position_embeddings"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7},
      "original_max_position_embeddings": 64},
     "longrope long_factor has 7 entries, expected head_dim / 2 = 8"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "unsupported rope_scaling type 'dynamic'; supported: default, linear, llama3, yarn, "
     "longrope"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     "yarn rope_scaling needs original_max_position_embeddings"),
])
def test_phi3_variants_kvslim_cannot_run_are_refused(extra, message):
    assert ModelConfig.from_hf_dict(PHI3).model_type == "phi3"
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**PHI3, **extra})


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": []}


def test_qwen3_moe_reads_its_experts_and_writes_them_back():
    from kvslim.models.shape_only import MoEConfig
    cfg = ModelConfig.from_hf_dict(QWEN3_MOE)
    assert cfg.runnable and cfg.model_type == "qwen3_moe"
    assert cfg.qk_norm and cfg.sliding_window is None and not cfg.qkv_bias
    assert cfg.moe == MoEConfig(8, 2, 32, norm_topk_prob=True)
    # transformers 5 saves the count under its alias; the flag defaults to false, as there
    alias = {k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "norm_topk_prob")}
    moe = ModelConfig.from_hf_dict({**alias, "num_local_experts": 8}).moe
    assert moe == MoEConfig(8, 2, 32, norm_topk_prob=False)
    written = cfg.replace(raw={}).to_hf_dict()                 # as a GGUF import writes it
    assert ModelConfig.from_hf_dict(written).moe == cfg.moe
    assert "num_local_experts" not in ModelConfig.from_hf_dict({**alias, "num_local_experts": 8}
                                                               ).to_hf_dict()


@pytest.mark.parametrize("extra", [{"decoder_sparse_step": 2}, {"mlp_only_layers": [1]}])
def test_qwen3_moe_with_dense_layers_is_refused(extra):
    with pytest.raises(ConfigError, match="make some layers dense; kvslim runs Qwen3-MoE with "
                                          "experts in every layer"):
        ModelConfig.from_hf_dict({**QWEN3_MOE, **extra})


def test_qwen2_moe_is_refused_naming_what_runs():
    cfg = {**QWEN3_MOE, "architectures": ["Qwen2MoeForCausalLM"]}
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf_dict(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("unsupported architecture 'Qwen2MoeForCausalLM'; kvslim supports ")
    assert "MixtralForCausalLM, Qwen3MoeForCausalLM" in message
