"""Tiny random HF checkpoints written by transformers' own `save_pretrained`, one per variant the
model must match (MHA, GQA, MQA, Qwen2 biases, tied embeddings, llama3 RoPE, odd head_dim, sharded).
Weights use a larger init than HF's default so that greedy argmax margins are far above float
rounding, which makes token-for-token comparisons meaningful rather than flaky."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320
TOKENIZER_VOCAB = 300
TOKENIZER_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. In the beginning God created the heaven and the earth. "
    "The kernel schedules tasks; memory is managed in pages of 4096 bytes. ") * 40 + "é ü 日本 ✓\n"

VARIANTS: dict[str, dict] = {
    "mha": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4),
    "mha8": dict(arch="llama", num_attention_heads=8, num_key_value_heads=8),   # gqa/mqa's twin
    "gqa": dict(arch="llama", num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(arch="llama", num_attention_heads=8, num_key_value_heads=1),
    "qwen2_bias": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    "phi3": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2),   # fused qkv
    # Phi-3's LongRoPE: short factors within the first 48 positions, long ones beyond
    "phi3_longrope": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2,
                          original_max_position_embeddings=48,
                          rope_scaling={"type": "longrope",
                                        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0,
                                                        16.0]}),
    # 4 experts, 2 per token, a window shorter than the longer prompts
    "mixtral": dict(arch="mixtral", num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    # Qwen3's q/k norms, 6 experts of their own width, 2 per token, their weights not
    # renormalised (transformers' default for the flag Mixtral does not have)
    "qwen3_moe": dict(arch="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                      num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=False),
    "yarn_rope": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 16}),
    # local layers with a window shorter than most prompts between global ones, each with
    # its own RoPE base; MQA, head_dim != hidden / heads, an attention scale != head_dim
    "gemma3": dict(arch="gemma3", num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                   num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                     "sliding_attention"],
                   sliding_window=7, query_pre_attn_scalar=24,
                   rope_parameters={"full_attention": {"rope_type": "default",
                                                       "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 1000.0}}),
    "tied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=True),
    "llama3_rope": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2,
                        rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16}),
    "head_dim": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    "sharded": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, shard="60KB"),
    # DeepSeek's latent attention (MLA): q straight from the hidden state, a first dense layer,
    # then routed experts (2 of 8, chosen within the best 2 of 4 groups by their top expert,
    # scaled) beside a shared one
    "deepseek_v2": dict(arch="deepseek_v2", num_attention_heads=4, num_hidden_layers=3,
                        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, routed_scaling_factor=1.5),
    # ... with q through its own low-rank projection and norm, greedy routing over 6 experts
    "deepseek_v2_q_lora": dict(arch="deepseek_v2", num_attention_heads=4, q_lora_rank=24,
                               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=16, n_routed_experts=6, n_shared_experts=2,
                               num_experts_per_tok=2, moe_intermediate_size=32,
                               first_k_dense_replace=1, topk_method="greedy"),
    # DeepSeek-V3: sigmoid router with its selection bias (noaux_tc: groups ranked by their top
    # two), renormalised, scaled; YaRN RoPE whose mscale_all_dim also scales the logits
    "deepseek_v3": dict(arch="deepseek_v3", num_attention_heads=4, num_key_value_heads=4,
                        num_hidden_layers=3,
                        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                         "factor": 32.0, "original_max_position_embeddings": 16,
                                         "mscale": 1.0, "mscale_all_dim": 0.8,
                                         "beta_fast": 32, "beta_slow": 1}),
}


def hf_config(variant: str):
    from transformers import (DeepseekV2Config, DeepseekV3Config, Gemma3TextConfig, LlamaConfig,
                              MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config,
                              Qwen3MoeConfig)
    spec = dict(VARIANTS[variant])
    arch = spec.pop("arch")
    spec.pop("shard", None)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
           "qwen3": Qwen3Config, "phi3": Phi3Config, "gemma3": Gemma3TextConfig,
           "mixtral": MixtralConfig, "qwen3_moe": Qwen3MoeConfig,
           "deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config}[arch]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=512, initializer_range=0.15, bos_token_id=None,
                eos_token_id=None, pad_token_id=None, rms_norm_eps=1e-5)
    if arch == "mistral":
        base["sliding_window"] = None
    base.update(spec)
    return cls(**base)


def make_hf_model(variant: str, seed: int = 0):
    return random_hf_model(hf_config(variant), seed)


def random_hf_model(config, seed: int = 0):
    """A transformers model of `config` with random weights, biases and norms included."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():                   # HF zero-initialises biases and ones norms: randomise
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():   # DeepSeek-V3's expert selection bias
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


def write_random_checkpoint(config, root: Path, seed: int = 0) -> Path:
    """`random_hf_model(config)` saved with the test tokenizer (a variant's config, edited)."""
    random_hf_model(config, seed).save_pretrained(root)
    write_tokenizer(root)
    return root


def dense_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from a kvslim model's dense forward, recomputing the whole sequence."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model.logits(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def write_tokenizer(path: Path) -> None:
    """A small byte-level BPE trained by the project's own trainer (ids < VOCAB)."""
    from kvslim.train.tokenizer_train import train_tokenizer
    text = path / "tokenizer_text.txt"
    path.mkdir(parents=True, exist_ok=True)
    text.write_text(TOKENIZER_TEXT)
    train_tokenizer([text], TOKENIZER_VOCAB, path, show_progress=False)
    text.unlink()


def write_checkpoint(variant: str, path: Path, seed: int = 0) -> Path:
    model = make_hf_model(variant, seed)
    shard = VARIANTS[variant].get("shard")
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    write_tokenizer(path)
    return path
