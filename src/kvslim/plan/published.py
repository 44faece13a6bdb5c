"""Published models the memory planner knows by name: excerpts of each model's own `config.json`,
keys spelled as in the file, so every number can be checked against its source repository;
nothing here is derived by hand. They are read by `ModelConfig.from_hf_dict`, the parser the
engine uses for the models it loads; parameter counts are computed from the shapes
(`plan/parameters.py`), never copied from a model card."""
from __future__ import annotations

from typing import Any

from kvslim.models.config import ModelConfig

_LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "tie_word_embeddings": False}

PUBLISHED_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "Llama-2-7B": ("meta-llama/Llama-2-7b-hf", {
        **_LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "torch_dtype": "float16"}),
    # https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json
    "Llama-2-13B": ("meta-llama/Llama-2-13b-hf", {
        **_LLAMA, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "torch_dtype": "float16"}),
    # https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json
    "Llama-2-70B": ("meta-llama/Llama-2-70b-hf", {
        **_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "torch_dtype": "float16"}),
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "Llama-3-8B": ("meta-llama/Meta-Llama-3-8B", {
        **_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "torch_dtype": "bfloat16"}),
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    "Llama-3-70B": ("meta-llama/Meta-Llama-3-70B", {
        **_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "torch_dtype": "bfloat16"}),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "Mistral-7B": ("mistralai/Mistral-7B-v0.1", {
        **_LLAMA, "architectures": ["MistralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
        "sliding_window": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16"}),
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    "Mixtral-8x7B": ("mistralai/Mixtral-8x7B-v0.1", {
        **_LLAMA, "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "torch_dtype": "bfloat16"}),
    # https://huggingface.co/Qwen/Qwen2-7B/blob/main/config.json
    "Qwen2-7B": ("Qwen/Qwen2-7B", {
        **_LLAMA, "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
        "use_sliding_window": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16"}),
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json
    "SmolLM2-135M": ("HuggingFaceTB/SmolLM2-135M", {
        **_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"}),
    # https://huggingface.co/deepseek-ai/DeepSeek-V2/blob/main/config.json
    # MLA attention (kv_lora_rank, qk_rope_head_dim) and fine-grained MoE (160 routed + 2 shared).
    "DeepSeek-V2": ("deepseek-ai/DeepSeek-V2", {
        "architectures": ["DeepseekV2ForCausalLM"], "hidden_act": "silu", "hidden_size": 5120,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 60,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 160,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}),
}


def builtin_names() -> list[str]:
    return list(PUBLISHED_CONFIGS)


def builtin_config(name: str) -> ModelConfig | None:
    """A built-in model by its name or its HF repository, case-insensitively; None if unknown."""
    for key, (source, cfg) in PUBLISHED_CONFIGS.items():
        if name.lower() in (key.lower(), source.lower()):
            return ModelConfig.from_hf_dict(cfg, runnable=False, name=key, source=source)
    return None
