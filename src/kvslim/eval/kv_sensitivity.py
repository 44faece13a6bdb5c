"""Each layer's measured sensitivity to its KV setting, the KV budget compiler's losses
(kv_cache/budget.py): the KL divergence of the next-token distribution when one layer alone
stores its keys and values at a precision (quantized and read back) and/or attends only to
sinks + a window, against the model with every layer exact, over windows of calibration text.

The dense pass degrades the whole layer at once: a packed precision quantizes every block of
the window (the engine keeps the block being filled, and its residual ones, in float16), so a
packed setting's loss is an upper estimate; int8 and fp8 are the engine's arithmetic."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvslim.attention.dense import DenseAttention
from kvslim.attention.kv_cache import dequantize, quantize
from kvslim.dtypes import QUANTIZED_KV_DTYPES, packed_kv_bits, parse_dtype
from kvslim.kernels.lowbit_codes import (dequantize_keys, dequantize_values,
                                         quantize_key_blocks, quantize_value_blocks)
from kvslim.kv_cache.budget import KVSetting


def degrade(x: torch.Tensor, precision: str, block_size: int, keys: bool) -> torch.Tensor:
    """x [B, T, kv_heads, D] stored in `precision` and read back ("auto": unchanged)."""
    if precision in ("auto", None):
        return x
    bits = packed_kv_bits(precision)
    if bits is None:
        dtype = parse_dtype(QUANTIZED_KV_DTYPES.get(precision, precision))
        q, scale = quantize(x, dtype)
        return dequantize(q, scale, torch.float32).to(x.dtype)
    b, t = x.shape[:2]
    pad = -t % block_size
    blocks = F.pad(x.float(), (0, 0, 0, 0, 0, pad)).reshape(-1, block_size, *x.shape[2:])
    if keys:
        out = dequantize_keys(*quantize_key_blocks(blocks, bits), bits)
    else:
        out = dequantize_values(*quantize_value_blocks(blocks, bits), bits)
    return out.reshape(b, t + pad, *x.shape[2:])[:, :t].to(x.dtype)


class DegradedAttention(DenseAttention):
    """Dense causal attention in which `layer` alone stores K and V in `precision` (and sees
    sinks + a window when the setting has one; the others see everything)."""

    def __init__(self, seq_len: int, device, layer: int, setting: KVSetting, num_layers: int,
                 sinks: int, block_size: int):
        windows = [setting.window if i == layer else None for i in range(num_layers)]
        super().__init__(seq_len, device, None, windows, {setting.window: sinks})
        self.layer, self.setting, self.block_size = layer, setting, block_size

    def attend(self, layer_idx: int, q, k, v, scale: float):
        if layer_idx == self.layer:
            k = degrade(k, self.setting.precision, self.block_size, keys=True)
            v = degrade(v, self.setting.precision, self.block_size, keys=False)
        return super().attend(layer_idx, q, k, v, scale)


@torch.inference_mode()
def layer_sensitivity(model, batches: list[torch.Tensor], settings: list[KVSetting],
                      sinks: int = 4, block_size: int = 16) -> list[dict[KVSetting, float]]:
    """Per layer, per setting: the mean KL(exact || degraded) of the next-token distributions
    over `batches` ([B, T] token ids each)."""
    n = model.config.num_hidden_layers
    out = [dict.fromkeys(settings, 0.0) for _ in range(n)]
    for ids in batches:
        exact = F.log_softmax(model.logits(ids).float(), -1)
        positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
        for layer in range(n):
            for setting in settings:
                attn = DegradedAttention(ids.shape[-1], ids.device, layer, setting, n, sinks,
                                         block_size)
                hidden = model(ids, positions=positions, attn=attn)
                logp = F.log_softmax(model.compute_logits(hidden).float(), -1)
                kl = F.kl_div(logp, exact, log_target=True, reduction="none").sum(-1).mean()
                out[layer][setting] += float(kl) / len(batches)
    return out
