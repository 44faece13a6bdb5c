"""SmoothQuant (Xiao et al. 2022) for W8A8, and the per-channel int8 weight quantizer it feeds.

Per-token int8 activations lose the small channels of a row whose few outlier channels set its
scale. SmoothQuant moves that range into the weights: per input channel j of a group of linears
sharing an input, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (max over the calibration rows,
and over the group's rows of W), and W x = (W * s)(x / s). 1/s is folded into the op before
the group, exactly as AWQ folds its scales (`awq.py`'s helpers, reused): the RMSNorm weights
for q/k/v and gate/up, the up rows for down, and the v rows for o when every query head has
its own v head (under GQA/MQA a v head feeds several query heads, so o is left alone). The
float model computes the same function; alpha = 0.5 is the paper's default for most models."""
from __future__ import annotations

import torch

from kvslim.formats.gptq import QuantizedWeight
from kvslim.surgery.quantize.awq import _divide_rows, _fold_into_norm, _scale_columns

TINY = 1e-5                 # floor for max|X_j| and max|W_j|: a dead channel keeps s finite


def smooth_scale(weight: torch.Tensor, x_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [in] for weight [out, in] whose inputs have per-channel max |x| `x_absmax` [in]."""
    w_absmax = weight.detach().float().abs().amax(dim=0).clamp(min=TINY)
    return x_absmax.float().clamp(min=TINY).pow(alpha) / w_absmax.pow(1 - alpha)


@torch.no_grad()
def smooth_layer(layer: torch.nn.Module, inputs: dict[str, torch.Tensor], alpha: float,
                 dtype: torch.dtype = torch.float32) -> None:
    """Fold SmoothQuant scales into one decoder layer in place (float weights). `inputs` maps
    the linears' names (as in awq.fold_layer) to their captured inputs [n, in]; `dtype` is the
    one the norms are stored in."""
    attn, mlp = layer.self_attn, layer.mlp
    absmax = {name: x.abs().amax(dim=0) for name, x in inputs.items()}

    s = smooth_scale(mlp.down_proj.weight, absmax["mlp.down_proj"], alpha)
    _divide_rows(mlp.gate_up_proj, mlp.gate_up_proj.shard_rows("up"), s)
    _scale_columns(mlp.down_proj, s)

    if attn.num_heads == attn.num_kv_heads:
        s = smooth_scale(attn.o_proj.weight, absmax["self_attn.o_proj"], alpha)
        _divide_rows(attn.qkv_proj, attn.qkv_proj.shard_rows("v"), s)
        _scale_columns(attn.o_proj, s)

    for name, linear, norm in (("mlp.gate_up_proj", mlp.gate_up_proj,
                                layer.post_attention_layernorm),
                               ("self_attn.qkv_proj", attn.qkv_proj, layer.input_layernorm)):
        s = smooth_scale(linear.weight, absmax[name], alpha)
        _scale_columns(linear, _fold_into_norm(norm, s, dtype))


def int8_per_channel(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one float32 scale per output row, max|w| / 127: codes in
    [-127, 127], stored as q = code + 128 over a zero point of 128 (QuantizedWeight's form)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).long()
    return QuantizedWeight(codes + 128, torch.full((1, w.shape[0]), 128, dtype=torch.long),
                           scale[None], torch.zeros(w.shape[1], dtype=torch.int32))
