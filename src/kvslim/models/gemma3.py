"""Gemma 3 (text): the Llama decoder's pieces arranged Gemma's way.

- embeddings scaled by sqrt(hidden_size), tied LM head (a GGUF file's quantized import keeps
  the table in its blocks for both, as Llama's does);
- RMSNorm with a (1 + w) weight (`GemmaRMSNorm`), around both sublayers: input and
  post-attention norms, pre- and post-feed-forward norms;
- q and k heads normalised before RoPE, logits scaled by query_pre_attn_scalar ** -0.5;
- GeGLU feed-forward (tanh-approximated GELU);
- local layers (a sliding window, RoPE base `rope_local_theta`) between global ones (the whole
  context, `rope_theta` with its scaling), as `layer_types` says.

Checkpoint names are the Llama family's plus the two feed-forward norms, so loading, surgery and
writing reuse `LlamaForCausalLM`'s rule unchanged.

llama.cpp's `gemma3` files differ from `llama` ones: four norms per layer and per-head q/k
norms under their own tensor names; norm weights stored as (1 + w) (llama.cpp multiplies by the
weight, Gemma by one plus it, so the converter adds the one and the importer takes it off
again); Q and K rows not permuted (llama.cpp runs Gemma with HF's half-split RoPE). What the
file does not say, llama.cpp fixes for the architecture, and so does the importer: every sixth
layer is global and the others slide over `attention.sliding_window` tokens, the local layers'
RoPE base is 10000, and the attention scale is 1 / sqrt(head_dim)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvslim.errors import ConfigError

from kvslim.layers.mlp import SwiGLUMLP
from kvslim.layers.norm import GemmaRMSNorm
from kvslim.layers.rope import RotaryEmbedding
from kvslim.layers.self_attention import Attention
from kvslim.models.base import QK_NORM_TENSORS, Family, GGUFLayout, write_attention_bias
from kvslim.models.hf_fields import rope_from_hf
from kvslim.kernels.decoder_layer import NativeDecoderLayer, NativeDecoderStack
from kvslim.models.llama import (LLAMA_LAYER_TENSORS, LlamaForCausalLM, make_lm_head,
                                 native_layer_of)
from kvslim.quantization.gguf_embedding import BlockQuantEmbedding

if TYPE_CHECKING:
    from kvslim.models.config import ModelConfig


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_sliding_windows[layer_idx] is not None
        self.self_attn = Attention(h, config.num_attention_heads, config.kv_heads_of(layer_idx),
                                   config.head_dim, layer_idx, config.qkv_bias, config.o_bias,
                                   config.quantization, qk_norm_eps=eps,
                                   qk_norm_cls=GemmaRMSNorm,
                                   scale=float(config.query_pre_attn_scalar) ** -0.5)
        self.mlp = SwiGLUMLP(h, config.intermediate_size, config.mlp_bias, config.quantization,
                             activation=config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    native: NativeDecoderLayer | None = None

    def forward(self, x, rope, attn):
        cos, sin = rope["local" if self.is_sliding else "global"]
        if self.native is not None and x.dim() == 2 and not torch.compiler.is_compiling():
            inputs = getattr(attn, "native_inputs", lambda _: None)(self.self_attn.layer_idx)
            if inputs is not None:
                return self.native(x, cos, sin, inputs)
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def prepare_native(self) -> None:
        """As the Llama layer's: the sandwich norms and the q/k head norms go to the op too."""
        attn = self.self_attn
        self.native = native_layer_of(self, [self.input_layernorm, self.post_attention_layernorm,
                                             self.pre_feedforward_layernorm,
                                             self.post_feedforward_layernorm, attn.q_norm,
                                             attn.k_norm])


class Gemma3Model(nn.Module):
    native: NativeDecoderStack | None = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        quant = config.quantization
        # The quantized import's token table stays in its GGUF blocks (Q8_0 in the 270M file)
        self.embed_tokens = (BlockQuantEmbedding(config.vocab_size, config.hidden_size)
                             if quant is not None and quant.embedding
                             else nn.Embedding(config.vocab_size, config.hidden_size))
        self.embed_scale = config.hidden_size ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.rope_local_theta, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                long_rope: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers scales by the square root rounded to the embeddings' dtype (a block table
        # gives its rows in float32, as the float import's table is)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = {"global": self.rotary.cos_sin(positions, x.dtype, long_rope),
                "local": self.local_rotary.cos_sin(positions, x.dtype)}
        inputs = self.native.inputs(self.layers, x, attn) if self.native is not None else None
        if inputs is not None:
            kinds = [rope["local" if layer.is_sliding else "global"] for layer in self.layers]
            return self.norm(self.native(x, [c for c, _ in kinds], [s for _, s in kinds], inputs))
        for layer in self.layers:
            x = layer(x, rope, attn)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = make_lm_head(config, self.model.embed_tokens)


# ---- config.json ---------------------------------------------------------------------------
def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields a Gemma 3 config.json sets its own way: local and global layers
    (`layer_types`, or the older `sliding_window_pattern`), each with its RoPE base
    (`rope_parameters` per layer type, or the older `rope_theta` + `rope_local_base_freq`), the
    attention scale's `query_pre_attn_scalar`, tied embeddings by default."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(f"config.json: {key} is not supported (Gemma 3 sets it to null)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("config.json: use_bidirectional_attention is not supported")
    n, pattern = int(cfg["num_hidden_layers"]), int(cfg.get("sliding_window_pattern", 6))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full = dict(params["full_attention"])
        theta = float(full.pop("rope_theta", 1_000_000.0))
        local = float((params.get("sliding_attention") or {}).get("rope_theta", 10_000.0))
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        theta, scaling = rope_from_hf({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)})
        local = float(cfg.get("rope_local_base_freq", 10_000.0))
    head_dim = int(cfg.get("head_dim") or 256)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local,
                layer_types=tuple(types), sliding_window=cfg.get("sliding_window"),
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", head_dim),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qk_norm=True)


def write_hf(config: ModelConfig, cfg: dict[str, Any]) -> None:
    """The same fields written back the way transformers' Gemma3TextConfig reads them."""
    write_attention_bias(config, cfg)
    cfg.pop("rope_theta", None)
    full = {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    cfg.update({"hidden_activation": config.hidden_act, "layer_types": list(config.layer_types),
                "sliding_window": config.sliding_window,
                "query_pre_attn_scalar": config.query_pre_attn_scalar,
                "rope_parameters": {"full_attention": full,
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": config.rope_local_theta}},
                "final_logit_softcapping": None, "attn_logit_softcapping": None})


# ---- GGUF ----------------------------------------------------------------------------------
SLIDING_PATTERN = 6           # layers 5, 11, 17, ... are global
LOCAL_ROPE_THETA = 10_000.0
LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS, **QK_NORM_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_fields(key, optional, head_dim: int) -> dict[str, Any]:
    types = tuple("sliding_attention" if (i + 1) % SLIDING_PATTERN else "full_attention"
                  for i in range(int(key("block_count"))))
    return dict(hidden_act="gelu_pytorch_tanh", layer_types=types, qk_norm=True,
                rope_local_theta=LOCAL_ROPE_THETA, query_pre_attn_scalar=head_dim)


# AWQ and SmoothQuant fold scales into the norm before each linear; Gemma's (1 + w) norms, and
# its post-attention norm that follows o_proj instead of preceding the MLP, do not fit that.
FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 3", Gemma3ForCausalLM,
                hf_fields=hf_fields, write_hf=write_hf, norms_per_layer=4, scale_folding=False,
                gguf=GGUFLayout("gemma3", LAYER_TENSORS, norms_plus_one=True,
                                sliding_window=True, exports=False,
                                fields=gguf_fields))
