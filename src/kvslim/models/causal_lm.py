"""The generic causal language model every family extends (`CausalLM`): what the engine, the
loaders, surgery and training call, written once. Parameter names follow HF transformers except
for the fused projections, q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`);
`packed_modules_mapping` is the weight-name rule between the two, used by `load_weights`
(checkpoint in) and `hf_state_dict` (checkpoint out)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvslim.attention import DenseAttention
from kvslim.kernels.decoder_layer import NativeDecoderStack
from kvslim.layers.linear import Linear, ShardedLinear
from kvslim.quantization import QuantLinear
from kvslim.quantization.base import prepare_linears_for_inference

if TYPE_CHECKING:
    from kvslim.models.config import ModelConfig


def default_positions(input_ids: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    if padding_mask is None:
        return torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    # Left padding: each row's first real token is position 0.
    return (padding_mask.long().cumsum(-1) - 1).clamp(min=0)


class CausalLM(nn.Module):
    """A decoder-only language model as the rest of kvslim sees it, whatever its family: `model`
    (the token embeddings, the decoder layers, the final norm and the rotary embedding; see
    models/llama.py's LlamaModel) and `lm_head`, which each family's subclass builds in its
    `__init__`; the forward pass, the logits, and the checkpoint names in and out are here,
    shared. Code outside models/ names this class, not a family's."""
    config: ModelConfig
    model: nn.Module
    lm_head: nn.Module

    # checkpoint module name -> (this model's module name, shard id in it)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn=None, padding_mask: torch.Tensor | None = None,
                long_rope: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm. Without `attn`, input_ids is a dense [B, T] batch
        attended causally (with `padding_mask` [B, T] marking real tokens, if any).
        long_rope (LongRoPE): the tokens whose sequence is longer than the original context
        (layers/rope.py); a dense pass decides it from its longest position."""
        if positions is None:
            positions = default_positions(input_ids, padding_mask)
        if attn is None:
            attn = DenseAttention(input_ids.shape[-1], input_ids.device, padding_mask,
                                  list(self.config.layer_sliding_windows))
            long_rope = self.model.rotary.long_for_pass(positions)
        return self.model(input_ids, positions, attn, long_rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def logits(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Convenience for training and evaluation: [B, T] ids -> [B, T, vocab] logits."""
        return self.compute_logits(self(input_ids, padding_mask=padding_mask))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into their (possibly fused) parameters; returns the
        names loaded. Names and shapes are the caller's to check (see `hf_state_dict`)."""
        params = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        loaded = set()
        for name, tensor in weights:
            target, shard_id = name, None
            for hf_part, (part, shard) in self.packed_modules_mapping.items():
                if f".{hf_part}." in name:
                    target, shard_id = name.replace(f".{hf_part}.", f".{part}."), shard
                    break
            module = self.get_submodule(target.rpartition(".")[0])
            if isinstance(module, (Linear, QuantLinear)):
                module.weight_loader(params[target], tensor, shard_id)
            else:
                with torch.no_grad():
                    params[target].copy_(tensor)
            loaded.add(name)
        return loaded

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict under HF checkpoint names, in HF's order: a fused parameter appears as
        one view per shard (sharing its memory), each shard's weight before its bias; a
        quantized layer as its GPTQ tensors (qweight, qzeros, scales, g_idx, bias) per shard."""
        hf_name = {(part, self._shard_key(part, shard)): hf_part
                   for hf_part, (part, shard) in self.packed_modules_mapping.items()}
        state = self.state_dict()
        out, done = {}, set()
        for name, tensor in state.items():
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, QuantLinear):
                views = module.checkpoint_views() if module_name not in done else {}
            elif isinstance(module, ShardedLinear) and leaf == "weight":
                bias = state.get(f"{module_name}.bias")
                biases = module.shard_views(bias) if bias is not None else {}
                views = {key: {"weight": w, **({"bias": biases[key]} if key in biases else {})}
                         for key, w in module.shard_views(tensor).items()}
            elif isinstance(module, ShardedLinear):
                continue                     # a bias: emitted with the weight's shards
            else:
                out[name] = tensor
                continue
            done.add(module_name)
            parent, _, part = module_name.rpartition(".")
            for key, leaves in views.items():
                prefix = module_name if key is None else f"{parent}.{hf_name[part, key]}"
                out.update({f"{prefix}.{leaf}": t for leaf, t in leaves.items()})
        return out

    def _shard_key(self, part: str, shard_id):
        module = next(m for n, m in self.named_modules() if n.endswith(f".{part}"))
        return module.shard_key(shard_id)

    def prepare_for_inference(self) -> bool:
        """Once the weights are loaded: choose each linear layer's kernel (see
        `prepare_linears_for_inference`), then where a decoder layer can run as one native call.
        The model is for inference only afterwards."""
        prepared = prepare_linears_for_inference(self)
        layers = self.model.layers
        for layer in layers:
            if hasattr(layer, "prepare_native"):
                layer.prepare_native()
        self.model.native = NativeDecoderStack.of([getattr(m, "native", None) for m in layers])
        return prepared
