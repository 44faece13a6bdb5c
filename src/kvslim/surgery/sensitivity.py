"""How much each layer loses when only its KV heads are merged: the predicted loss that
`kv_budget.allocate` spends a KV-head budget against.

For every layer and every candidate count K below its source count, the layer alone is
converted (by the conversion method itself, `align` or a pooling) and the model's next-token
distribution on calibration windows is compared with the unconverted model's: the cost is the
mean KL(source || converted) in nats per token. A K-head layer is evaluated inside the
unconverted model's shapes by giving each of its K merged heads to the src/K source head slots
of its group: query head j reads slot j // (H / src), and j // (H / K) is that slot's group, so
the result computes exactly what the K-head layer computes, without rebuilding the module."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from kvslim.models.causal_lm import CausalLM
from kvslim.surgery.align import _ATTN_NAMES, merge_layer
from kvslim.surgery.calibrate import attention_inputs
from kvslim.surgery.kv_budget import candidate_heads
from kvslim.surgery.pooling import pool_heads
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.train.data import eval_windows, tokenize_file
from kvslim.train.distill import soft_kl


def expand_heads(weights: dict[str, torch.Tensor], kv_heads: int, src_kv: int,
                 head_dim: int) -> dict[str, torch.Tensor]:
    """A K-head layer's k/v projections (and biases) given back to `src_kv` head slots."""
    out = dict(weights)
    for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        if name in weights:
            t = weights[name].reshape(kv_heads, head_dim, *weights[name].shape[1:])
            out[name] = t.repeat_interleave(src_kv // kv_heads, dim=0).reshape(
                src_kv * head_dim, *weights[name].shape[1:])
    return out


@torch.no_grad()
def layer_sensitivity(model: CausalLM, tokenizer: Tokenizer, calib: str | Path,
                      method: str, num_samples: int = 8, seq_len: int = 256,
                      calib_samples: int = 32, show_progress: bool = True
                      ) -> list[dict[int, float]]:
    """Per layer, {K: mean KL per token} for every candidate K (its source count costs 0)."""
    config = model.config
    windows = eval_windows(tokenize_file(calib, tokenizer, show_progress), seq_len,
                           num_samples)[:, :seq_len]
    reference = _logits(model, windows)
    inputs = (attention_inputs(model, tokenizer, calib, calib_samples, seq_len, show_progress)
              if method == "align" else None)
    state = model.hf_state_dict()
    costs: list[dict[int, float]] = []
    jobs = [(i, k) for i, k0 in enumerate(config.kv_heads_per_layer)
            for k in candidate_heads(k0)[1:]]
    bar = tqdm(total=len(jobs), desc="layer sensitivity", unit="conversion",
               disable=not show_progress)
    for i, k0 in enumerate(config.kv_heads_per_layer):
        prefix = f"model.layers.{i}.self_attn."
        original = {n: state[prefix + n].detach().clone().float()
                    for n in _ATTN_NAMES if prefix + n in state}
        layer_costs = {k0: 0.0}
        for k in candidate_heads(k0)[1:]:
            merged = _merge(original, method, None if inputs is None else inputs[i], config,
                            k0, k)
            _load(model, prefix, expand_heads(merged, k, k0, config.head_dim))
            layer_costs[k] = float(soft_kl(_logits(model, windows), reference, 1.0))
            bar.update()
        _load(model, prefix, original)
        costs.append(layer_costs)
    bar.close()
    return costs


def _merge(weights, method, x, config, src_kv: int, kv_heads: int) -> dict[str, torch.Tensor]:
    if method == "align":
        return merge_layer(weights, x, config.num_attention_heads, src_kv, kv_heads,
                           config.head_dim)
    out = dict(weights)
    for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        if name in weights:
            out[name] = pool_heads(weights[name], src_kv, kv_heads, method,
                                   torch.Generator().manual_seed(0))
    return out


def _load(model: CausalLM, prefix: str, weights: dict[str, torch.Tensor]) -> None:
    param = next(model.parameters())
    model.load_weights((prefix + n, t.to(param.dtype)) for n, t in weights.items())


def _logits(model: CausalLM, windows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    dev = next(model.parameters()).device
    return torch.cat([model.logits(windows[s:s + batch].to(dev)).float()
                      for s in range(0, len(windows), batch)])
