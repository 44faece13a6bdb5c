"""The GGUF architectures kvslim reads and writes, and what differs between them: the tensor
names of a layer, and whether llama.cpp's converter permuted the Q/K rows (only `llama`: the
others run with the same half-split RoPE as transformers). Mixtral files are `llama` ones with
experts (formats/gguf/moe.py)."""
from __future__ import annotations

LLAMA_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA3_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS, **QK_NORM_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 files keep the checkpoint's fused q/k/v and gate/up (models/phi3.py splits them)
PHI3_LAYER_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                      "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
                      "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# A sparse MoE layer's router and its experts' projections, each stacked over the experts
MOE_LAYER_TENSORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                     "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
LAYER_TENSORS = {"llama": {**LLAMA_LAYER_TENSORS, **MOE_LAYER_TENSORS},
                 "qwen2": LLAMA_LAYER_TENSORS,
                 "qwen3": {**LLAMA_LAYER_TENSORS, **QK_NORM_TENSORS},
                 "qwen3moe": {**LLAMA_LAYER_TENSORS, **QK_NORM_TENSORS, **MOE_LAYER_TENSORS},
                 "gemma3": GEMMA3_LAYER_TENSORS, "phi3": PHI3_LAYER_TENSORS}
# GGUF architecture -> the HF architecture it imports as
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                    "phi3": "Phi3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# ... and when the file has experts (`{arch}.expert_count`)
MOE_HF_ARCHITECTURES = {"llama": "MixtralForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# architectures kvslim imports as float32 only (no block-kept linears for their layouts)
FLOAT_ONLY = ("gemma3", "phi3")
# kvslim model type -> the GGUF architecture export-gguf writes (Mistral runs as llama)
EXPORT_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "phi3": "phi3",
                        "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "llama",
                        "qwen3_moe": "qwen3moe"}


def permutes_qk(arch: str) -> bool:
    return arch == "llama"
