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
from kvslim.kv_cache.layer_plan import KVLayerPlan


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
    """Dense causal attention in which each layer stores K and V in its setting's precision
    and sees sinks + its setting's window (None: exact, every token), narrowed by the layer's
    own window (`model_windows`) as the engine does (kv_cache/layer_plan.py's spans)."""

    def __init__(self, seq_len: int, device, settings: list[KVSetting | None], sinks: int,
                 block_size: int, model_windows: tuple[int | None, ...] | None = None):
        plan = KVLayerPlan(tuple(s or KVSetting("auto") for s in settings), sinks, seq_len)
        spans = [plan.span_over(i, w)
                 for i, w in enumerate(model_windows or (None,) * len(settings))]
        windows = [span.window for span in spans]
        super().__init__(seq_len, device, None, windows,
                         {span.window: span.sinks for span in spans})
        self.settings, self.block_size = settings, block_size

    def attend(self, layer_idx: int, q, k, v, scale: float):
        setting = self.settings[layer_idx]
        if setting is not None:
            k = degrade(k, setting.precision, self.block_size, keys=True)
            v = degrade(v, setting.precision, self.block_size, keys=False)
        return super().attend(layer_idx, q, k, v, scale)


LOGIT_ROWS = 256     # positions per logits chunk: a 262k vocabulary's logits stay ~256 MB


def _hidden(model, ids: torch.Tensor, attn=None) -> torch.Tensor:
    positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    return model(ids, positions=positions, attn=attn)


def _log_probs(model, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The next-token log-probabilities of `hidden` [B, T, H], a chunk of positions each."""
    return [F.log_softmax(model.compute_logits(hidden[:, i:i + LOGIT_ROWS]).float(), -1)
            for i in range(0, hidden.shape[1], LOGIT_ROWS)]


def _exact(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """The exact pass's log-probabilities, kept while every setting is compared with them (for
    a large vocabulary the logits cost as much as the layers: made once, not per setting)."""
    return _log_probs(model, _hidden(model, ids))


def _kl(model, ids: torch.Tensor, exact: list[torch.Tensor], settings: list[KVSetting | None],
        sinks: int, block_size: int) -> float:
    """Mean KL(exact || the pass with these per-layer settings) over the positions of `ids`;
    `exact`: `_exact`'s chunks."""
    attn = DegradedAttention(ids.shape[-1], ids.device, settings, sinks, block_size,
                             model.config.layer_sliding_windows)
    degraded = _hidden(model, ids, attn)
    total = 0.0
    for i, ref in zip(range(0, ids.shape[-1], LOGIT_ROWS), exact):
        logp = F.log_softmax(model.compute_logits(degraded[:, i:i + LOGIT_ROWS]).float(), -1)
        total += float(F.kl_div(logp, ref, log_target=True, reduction="none").sum())
    return total / ids.numel()


@torch.inference_mode()
def layer_sensitivity(model, batches: list[torch.Tensor], settings: list[KVSetting],
                      sinks: int = 4, block_size: int = 16,
                      progress=None) -> list[dict[KVSetting, float]]:
    """Per layer, per setting: the mean KL(exact || degraded) of the next-token distributions
    over `batches` ([B, T] token ids each) when that layer alone takes the setting."""
    n = model.config.num_hidden_layers
    out = [dict.fromkeys(settings, 0.0) for _ in range(n)]
    for ids in batches:
        exact = _exact(model, ids)
        for layer in range(n):
            for setting in settings:
                if setting == KVSetting("auto"):      # the exact pass itself: no loss
                    continue
                alone = [setting if i == layer else None for i in range(n)]
                out[layer][setting] += _kl(model, ids, exact, alone, sinks,
                                           block_size) / len(batches)
            if progress is not None:
                progress.update(1)
    return out


@torch.inference_mode()
def plan_kl(model, batches: list[torch.Tensor], settings: list[KVSetting], sinks: int = 4,
            block_size: int = 16) -> float:
    """The measured KL of every layer taking its own setting at once (a plan's validation)."""
    total = 0.0
    for ids in batches:
        exact = _exact(model, ids)
        total += _kl(model, ids, exact, list(settings), sinks, block_size) / len(batches)
    return total
