"""AWQ (Lin et al. 2023, activation-aware weight quantization), folded into ordinary weights.

Input channels that carry large activations matter more to a linear's output, so AWQ scales them
up before rounding: with a per-input-channel s, W x = (W * s)(x / s), and (W * s) is quantized
instead of W, which makes the salient columns' relative rounding error smaller. s is
mean|x|^alpha (normalised so max * min = 1), alpha searched on a grid over [0, 1) for the least
output error of the round-to-nearest (W * s) on x / s; alpha = 0 is plain RTN, so on the
calibration inputs a group never does worse than RTN. 1/s goes into the op before the linears
(the RMSNorm weight for q/k/v and gate/up, the up rows for down, the v rows for o when every
query head has its own v head) and s into the linears' columns: the float model computes the
same function, and the quantized checkpoint is an ordinary group-wise one (GPTQ layout).

Groups of one decoder layer, searched in this order on the inputs the float layer sees (the
folds are exact, so one capture serves all): down (into up), o (into v; skipped under GQA/MQA,
where a v head feeds several query heads whose o columns would need one shared scale), then
gate/up and q/k/v (into the norms) — each later search sees the rows an earlier fold rescaled."""
from __future__ import annotations

import torch

from kvslim.surgery.quantize.rtn import rtn_quantize

GRID = 20                   # alphas 0, 1/20, ..., 19/20, as in the reference implementation
SEARCH_ROWS = 4096          # calibration rows the output error is measured on


def _rows(x: torch.Tensor, limit: int = SEARCH_ROWS) -> torch.Tensor:
    step = max(1, len(x) // limit)
    return x[::step][:limit]


@torch.no_grad()
def search_scale(weight: torch.Tensor, x: torch.Tensor, bits: int, group_size: int,
                 sym: bool = True, grid: int = GRID) -> tuple[torch.Tensor, float, float]:
    """The per-input-channel scale s [in] for weight [out, in] on inputs x [n, in]; returns
    (s, relative output error of RTN(W * s) / s, that of plain RTN) on the searched rows."""
    weight, x = weight.float(), x.float()
    mean_abs = x.abs().mean(dim=0)
    x = _rows(x)
    ref = x @ weight.t()
    norm = ref.norm().item() or 1.0
    best, best_s, rtn_err = float("inf"), torch.ones_like(mean_abs), None
    for i in range(grid):
        s = mean_abs.pow(i / grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q = rtn_quantize(weight * s, bits, group_size, sym).dequantize() / s
        err = (x @ q.t() - ref).norm().item() / norm
        if i == 0:
            rtn_err = err
        if err < best:
            best, best_s = err, s
    return best_s, best, rtn_err


def _fold_into_norm(norm: torch.nn.Module, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Divide the norm's weight by s, rounded to the stored dtype; returns the scale the
    linears' columns must take for the product to stay what it was (s up to that rounding)."""
    old = norm.weight.detach().clone()
    new = (old / s).to(dtype).float()
    exact = torch.where((new != 0) & (old != 0), old / new, s)
    norm.weight.copy_(new)
    return exact


def _scale_columns(linear: torch.nn.Module, s: torch.Tensor) -> None:
    linear.weight.mul_(s.to(linear.weight.dtype))


def _divide_rows(linear: torch.nn.Module, rows: slice, s: torch.Tensor) -> None:
    linear.weight[rows].div_(s[:, None].to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias[rows].div_(s.to(linear.bias.dtype))


@torch.no_grad()
def fold_layer(layer: torch.nn.Module, inputs: dict[str, torch.Tensor], bits: int,
               group_size: int, sym: bool, dtype: torch.dtype = torch.float32) -> dict:
    """Search and fold the AWQ scales of one decoder layer in place (float weights, nothing
    quantized). `inputs` maps the linears' names (self_attn.qkv_proj, self_attn.o_proj,
    mlp.gate_up_proj, mlp.down_proj) to their captured float inputs [n, in]; `dtype` is the one
    the norms are stored in. Returns {group: (alpha error, RTN error)} for the searched groups."""
    attn, mlp = layer.self_attn, layer.mlp
    report = {}

    down_s, *report["mlp.down_proj"] = search_scale(mlp.down_proj.weight, inputs["mlp.down_proj"],
                                                    bits, group_size, sym)
    _divide_rows(mlp.gate_up_proj, mlp.gate_up_proj.shard_rows("up"), down_s)
    _scale_columns(mlp.down_proj, down_s)

    if attn.num_heads == attn.num_kv_heads:
        o_s, *report["self_attn.o_proj"] = search_scale(
            attn.o_proj.weight, inputs["self_attn.o_proj"], bits, group_size, sym)
        _divide_rows(attn.qkv_proj, attn.qkv_proj.shard_rows("v"), o_s)
        _scale_columns(attn.o_proj, o_s)

    for name, linear, norm in (("mlp.gate_up_proj", mlp.gate_up_proj,
                                layer.post_attention_layernorm),
                               ("self_attn.qkv_proj", attn.qkv_proj, layer.input_layernorm)):
        s, *report[name] = search_scale(linear.weight, inputs[name], bits, group_size, sym)
        _scale_columns(linear, _fold_into_norm(norm, s, dtype))
    return report


@torch.no_grad()
def clip_weight(weight: torch.Tensor, x: torch.Tensor, bits: int, group_size: int,
                sym: bool = True, grid: int = GRID, max_shrink: float = 0.5) -> torch.Tensor:
    """AWQ's clipping search: for each output row and group, the range [lo, hi] of the group
    (as RTN's grid takes it) shrunk by the ratio in 1, 1 - 0.5/20, ..., 0.525 whose RTN
    rounding gives that group's least output error on x [n, in]; returns weight clamped to it
    (rounding it then puts the grid on the shrunk range)."""
    weight, x = weight.float(), _rows(x.float(), SEARCH_ROWS // 2)
    out, n = weight.shape
    g = n if group_size == -1 else group_size
    w = weight.view(out, n // g, g)
    hi, lo = w.amax(dim=2).clamp(min=0), w.amin(dim=2).clamp(max=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    best = torch.full(hi.shape, float("inf"))
    best_ratio = torch.ones_like(hi)
    for i in range(grid):
        ratio = 1 - i / grid * max_shrink
        clipped = torch.clamp(w, (lo * ratio)[..., None], (hi * ratio)[..., None])
        diff = rtn_quantize(clipped.view(out, n), bits, g, sym).dequantize() - weight
        err = torch.stack([(x[:, k * g:(k + 1) * g] @ diff[:, k * g:(k + 1) * g].t())
                           .pow(2).mean(dim=0) for k in range(n // g)], dim=1)
        better = err < best
        best, best_ratio = torch.where(better, err, best), torch.where(better, ratio, best_ratio)
    lo, hi = (lo * best_ratio)[..., None], (hi * best_ratio)[..., None]
    return torch.clamp(w, lo, hi).view(out, n)


@torch.no_grad()
def clip_layer(layer: torch.nn.Module, inputs: dict[str, torch.Tensor], bits: int,
               group_size: int, sym: bool) -> None:
    """Clip every linear of the layer in place on its inputs (the folded layer's), except the q
    and k rows, whose errors the attention scores amplify (the reference skips them too)."""
    qkv = layer.self_attn.qkv_proj
    for name, linear, rows in (("self_attn.qkv_proj", qkv, qkv.shard_rows("v")),
                               ("self_attn.o_proj", layer.self_attn.o_proj, slice(None)),
                               ("mlp.gate_up_proj", layer.mlp.gate_up_proj, slice(None)),
                               ("mlp.down_proj", layer.mlp.down_proj, slice(None))):
        w = linear.weight[rows]
        w.copy_(clip_weight(w, inputs[name], bits, group_size, sym).to(w.dtype))
