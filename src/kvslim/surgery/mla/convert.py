"""`kvslim convert --to-mla`: a Llama-family model written as DeepSeek-V2
(`DeepseekV2ForCausalLM`: q_proj, no experts, every layer's MLP the source's), which transformers
and kvslim's engine (over its latent cache) both run.

Steps: every check (options.py) before anything is loaded; the attention inputs' covariance per
layer (calibration text, or the input norm's diag(g^2) without it); per layer the KV-head mixing
and the slot scores, summed over layers into the kept RoPE slots (frequencies.py); per layer the
DeepSeek tensors (factorize.py); config.json, the weights in the source's dtype, and
mla_conversion.json (what was chosen, the KV bytes per token before and after)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from kvslim.formats.loader import load_model
from kvslim.formats.writer import save_model
from kvslim.models.config import ModelConfig
from kvslim.models.families import MLA_FAMILY
from kvslim.dtypes import parse_dtype
from kvslim.surgery.mla.factorize import mla_layer
from kvslim.surgery.mla.frequencies import (choose_kept, mixing, pairs, rope_parameters,
                                            slot_scores)
from kvslim.surgery.mla.options import MLAOptions, check_options, rope_key_width

ATTENTION = ("q_proj", "k_proj", "v_proj")
RECORD = "mla_conversion.json"


def convert_to_mla(src: str | Path, dst: str | Path, options: MLAOptions,
                   show_progress: bool = True) -> Path:
    """Write `dst`, the model at `src` with latent attention as `options` asks."""
    source = ModelConfig.from_dir(src)
    check_options(source, options)
    model = load_model(src, dtype=torch.float32)
    covs = input_covariances(model, src, options, show_progress)
    state = model.hf_state_dict()
    rope_dim = options.rope_dim_for(source)
    mixes, kept = kept_slots(state, source, covs, options.method, rope_dim)
    out = {name: t for name, t in state.items()
           if not any(f".self_attn.{p}." in name for p in ATTENTION)}
    for layer in tqdm(range(source.num_hidden_layers), desc="factorizing", unit="layer",
                      disable=not show_progress):
        prefix = f"model.layers.{layer}.self_attn."
        w = [state[prefix + f"{p}.weight"].double() for p in ATTENTION]
        tensors = mla_layer(*w, covs[layer], mixes[layer], kept, options.method,
                            options.kv_lora_rank, options.latent_norm)
        out.update({prefix + name: t.float() for name, t in tensors.items()})
    config = mla_config(source, options, kept)
    path = save_model(out, config, dst, dtype=parse_dtype(source.torch_dtype), tokenizer_from=src)
    record = {"method": options.method, "kv_lora_rank": options.kv_lora_rank,
              "rope_dim": rope_dim, "qk_rope_head_dim": config.mla.qk_rope_head_dim,
              "latent_norm": options.latent_norm, "kept_per_frequency": kept,
              "calib": None if options.calib is None else str(options.calib),
              "source_kv_bytes_per_token": source.kv_bytes_per_token(source.torch_dtype),
              "kv_bytes_per_token": config.kv_bytes_per_token(config.torch_dtype)}
    (path / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return path


def input_covariances(model, src, options: MLAOptions, show_progress: bool) -> list[torch.Tensor]:
    """Per layer, E[x x^T] of the attention's input x (float64). Without calibration text:
    diag(g^2), g the layer's input norm weight (x = g * a hidden state of unit RMS), with the
    hidden state's directions taken as isotropic."""
    layers = model.model.layers
    if options.calib is None:
        return [torch.diag(layer.input_layernorm.weight.detach().double() ** 2)
                for layer in layers]
    from kvslim.surgery.calibrate import attention_inputs
    from kvslim.tokenizer.tokenizer import Tokenizer
    inputs = attention_inputs(model, Tokenizer.from_dir(src), options.calib,
                              options.calib_samples, options.calib_seq_len, show_progress)
    covs = []
    for x in inputs:
        x = x.double()
        cov = x.T @ x / x.shape[0]
        # a ridge keeps the covariance full rank when the text is shorter than the width
        covs.append(cov + torch.eye(cov.shape[0], dtype=cov.dtype) * 1e-6 * cov.trace() /
                    cov.shape[0])
    return covs


def kept_slots(state, config: ModelConfig, covs, method: str, rope_dim: int):
    """Per layer the KV-head mixing U [d/2, K, K], and the model's kept count per frequency."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    mixes, total = [], None
    for layer, cov in enumerate(covs):
        prefix = f"model.layers.{layer}.self_attn."
        qp = pairs(state[prefix + "q_proj.weight"].double(), heads)
        kp = pairs(state[prefix + "k_proj.weight"].double(), kv)
        u = mixing(kp, cov, method)
        scores = slot_scores(qp, kp, u, cov)
        mixes.append(u)
        total = scores if total is None else total + scores
    return mixes, choose_kept(total, method, rope_dim)


def mla_config(source: ModelConfig, options: MLAOptions, kept: list[int]) -> ModelConfig:
    """The DeepSeek-V2 config.json: dense MLPs (first_k_dense_replace = every layer, no
    experts), q_proj (no q_lora), the source's vocabulary, norms and context."""
    kv, d = source.num_key_value_heads, source.head_dim
    width = rope_key_width(source, options.method, options.rope_dim_for(source))
    nope = 2 * sum(1 for m in kept if m < kv)
    cfg = {"architectures": [MLA_FAMILY.architecture], "model_type": MLA_FAMILY.model_type,
           "vocab_size": source.vocab_size, "hidden_size": source.hidden_size,
           "intermediate_size": source.intermediate_size,
           "num_hidden_layers": source.num_hidden_layers,
           "num_attention_heads": source.num_attention_heads,
           "num_key_value_heads": source.num_attention_heads, "hidden_act": source.hidden_act,
           "rms_norm_eps": source.rms_norm_eps,
           "max_position_embeddings": source.max_position_embeddings,
           "tie_word_embeddings": source.tie_word_embeddings,
           "bos_token_id": source.bos_token_id,
           "eos_token_id": (source.eos_token_ids[0] if len(source.eos_token_ids) == 1
                            else source.eos_token_ids or None),
           "dtype": source.torch_dtype, "attention_bias": False, "mlp_bias": source.mlp_bias,
           "q_lora_rank": None, "kv_lora_rank": options.kv_lora_rank,
           "qk_nope_head_dim": nope, "qk_rope_head_dim": width, "v_head_dim": d,
           "n_routed_experts": 0, "first_k_dense_replace": source.num_hidden_layers,
           "rope_theta": source.rope_theta, "rope_parameters": rope_parameters(source, kept)}
    return ModelConfig.from_hf_dict(cfg, name=source.name)
