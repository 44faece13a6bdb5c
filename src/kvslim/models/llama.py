"""Llama, and the one GQA-native decoder the Llama family shares (Mistral, Qwen2, Phi-3; Qwen3:
the same decoder with each query and key head RMS-normalised before RoPE; Mixtral and Qwen3-MoE:
the Llama and Qwen3 decoders with a sparse mixture-of-experts MLP, layers/moe.py). Parameter
names follow HF transformers except for the fused projections, q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`), as models/causal_lm.py maps them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvslim.kernels import decoder_layer as native_layer
from kvslim.kernels.decoder_layer import NativeDecoderLayer, NativeDecoderStack
from kvslim.layers.linear import Linear, make_linear
from kvslim.layers.mlp import GATE_ACTIVATIONS, SwiGLUMLP
from kvslim.layers.moe import SparseMoE
from kvslim.layers.self_attention import Attention
from kvslim.layers.norm import GemmaRMSNorm, RMSNorm
from kvslim.layers.rope import RotaryEmbedding
from kvslim.quantization.kernels import q8_weight_of
from kvslim.quantization.gguf_embedding import BlockQuantEmbedding, TiedBlockQuantHead
from kvslim.models.base import Family, GGUFLayout, write_attention_bias
from kvslim.models.causal_lm import CausalLM

if TYPE_CHECKING:
    from kvslim.models.config import ModelConfig


class DecoderLayer(nn.Module):
    # a class default: families whose layers build their own modules (DeepSeek) inherit it
    native: NativeDecoderLayer | None = None

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config.hidden_size, config.num_attention_heads,
                                   config.kv_heads_of(layer_idx), config.head_dim, layer_idx,
                                   config.qkv_bias, config.o_bias, config.quantization,
                                   config.rms_norm_eps if config.qk_norm else None)
        self.mlp = (SparseMoE(config.hidden_size, config.moe.expert_intermediate_size,
                              config.moe.num_experts, config.moe.num_experts_per_tok,
                              norm_topk_prob=config.moe.norm_topk_prob)
                    if config.moe else
                    SwiGLUMLP(config.hidden_size, config.intermediate_size, config.mlp_bias,
                              config.quantization))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn):
        if self.native is not None and not torch.compiler.is_compiling():
            inputs = getattr(attn, "native_inputs", lambda _: None)(self.self_attn.layer_idx)
            if inputs is not None and x.dim() == 2:
                return self.native(x, cos, sin, inputs)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def prepare_native(self) -> None:
        """Once the kernels are chosen: the whole layer in one native call where its modules
        run what that call runs (kernels/decoder_layer.py), with the same bits."""
        attn = self.self_attn
        self.native = native_layer_of(self, [self.input_layernorm, None,
                                             self.post_attention_layernorm, None,
                                             getattr(attn, "q_norm", None),
                                             getattr(attn, "k_norm", None)])


def native_layer_of(layer: nn.Module, norms: list[nn.Module | None]) -> NativeDecoderLayer | None:
    """`layer` (self_attn, mlp) as one native call, or None where its modules do more than the
    op does. norms: the layer's six in the op's order (before attention, on its output, before
    the MLP, on its output, per query head, per key head), None where it has none; each one
    taken is marked native, so the modules run the op's norm kernel too."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or not isinstance(mlp, SwiGLUMLP):   # MLA, a MoE
        return None
    modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    linears = [q8_weight_of(getattr(m, "kernel", None)) for m in modules]
    # a module that does more than its kernel (a tensor-parallel shard's all-reduce hook)
    # keeps its forward
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (*modules, layer, attn, mlp))
    present = [n for n in norms if n is not None]
    act = GATE_ACTIVATIONS.get(mlp.act)
    if (None in linears or hooked or act is None or norms[0] is None or norms[2] is None
            or any(type(n) not in (RMSNorm, GemmaRMSNorm) for n in present)
            or len({n.eps for n in present}) != 1 or not native_layer.available()):
        return None
    for norm in present:
        norm.native = True
    return NativeDecoderLayer.of(linears, [n.kernel_weight() if n is not None else None
                                           for n in norms], present[0].eps, attn.num_heads,
                                 attn.num_kv_heads, attn.head_dim, attn.scale, act)


class LlamaModel(nn.Module):
    native: NativeDecoderStack | None = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        quant = config.quantization
        # A GGUF file's quantized token embeddings stay in their block form.
        self.embed_tokens = (BlockQuantEmbedding(config.vocab_size, config.hidden_size)
                             if quant is not None and quant.embedding
                             else nn.Embedding(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                long_rope: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype, long_rope)
        inputs = self.native.inputs(self.layers, x, attn) if self.native is not None else None
        if inputs is not None:
            n = len(self.layers)
            return self.norm(self.native(x, [cos] * n, [sin] * n, inputs))
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = make_lm_head(config, self.model.embed_tokens)


def make_lm_head(config: ModelConfig, embed_tokens: nn.Module) -> nn.Module:
    """Tied to the embeddings (the same tensor, or the same blocks), else its own weight."""
    quant = config.quantization
    if config.tie_word_embeddings and isinstance(embed_tokens, BlockQuantEmbedding):
        return TiedBlockQuantHead(embed_tokens, quant)
    if not config.tie_word_embeddings and quant is not None and quant.lm_head:
        return make_linear(config.hidden_size, config.vocab_size, False, quant)
    head = Linear(config.hidden_size, config.vocab_size, bias=False)
    if config.tie_word_embeddings:
        head.weight = embed_tokens.weight
    return head


def _write_hf(config: ModelConfig, cfg: dict[str, Any]) -> None:
    write_attention_bias(config, cfg)
    cfg["mlp_bias"] = config.mlp_bias


# A GGUF decoder layer's tensors (blk.N.<name>) -> kvslim's module names
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
GGUF = GGUFLayout("llama", LLAMA_LAYER_TENSORS, permutes_qk=True)
FAMILY = Family("llama", "LlamaForCausalLM", "Llama", LlamaForCausalLM, write_hf=_write_hf,
                gguf=GGUF, converts_to_mla=True)
