"""Quantize a whole model (`kvslim quantize`) and write it in the GPTQ checkpoint layout.

The decoder's linear layers are quantized in order — per decoder layer q/k/v, o, gate/up, down —
and GPTQ sees each one's inputs as the already-quantized layers before it produce them: the
inputs of decoder layer 0 are captured once on the calibration windows, every later layer runs
on the outputs of the quantized layer before it, and within a layer a forward hook on the linear
collects its Hessian while the layer runs. The fused q/k/v and gate/up matrices share their
input, so one Hessian (and one act-order permutation, one g_idx) serves all their shards;
quantizing them together is quantizing each shard, GPTQ treats output rows independently.
AWQ (`awq.py`) first folds its activation-aware scales into each layer's float weights (and its
norms) on the inputs that layer sees, clips each group's range, then rounds to nearest. W8A8
(`smoothquant.py`) rounds each output row to int8, after folding SmoothQuant's scales in when
asked, and is written in the compressed-tensors int-quantized layout.
Embeddings, norms and lm_head stay in the source dtype."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from kvslim.errors import KvslimError
from kvslim.formats.compressed_tensors_int import pack_w8a8
from kvslim.formats.gptq import QuantizedWeight, pack_gptq
from kvslim.formats.loader import load_model
from kvslim.formats.writer import save_model
from kvslim.quantization import QuantSpec
from kvslim.models.config import ModelConfig
from kvslim.dtypes import parse_dtype
from kvslim.models.families import family_of
from kvslim.models.causal_lm import CausalLM
from kvslim.surgery.quantize.awq import clip_layer, fold_layer
from kvslim.surgery.quantize.gptq import Hessian, gptq_quantize
from kvslim.surgery.quantize.rtn import rtn_quantize
from kvslim.surgery.quantize.smoothquant import int8_per_channel, smooth_layer

METHODS = ("rtn", "gptq", "awq", "w8a8")
CALIBRATED = ("gptq", "awq")         # methods that always need calibration text
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class _Captured(Exception):
    """Stops the forward pass once decoder layer 0's inputs are captured."""


def check_options(config: ModelConfig, method: str, spec: QuantSpec,
                  calib: str | Path | None, smooth_alpha: float | None = None) -> None:
    bits, group_size = spec.bits, spec.group_size
    if config.raw.get("quantization_config") is not None:
        method_name = config.raw["quantization_config"].get("quant_method")
        raise KvslimError(f"{config.source or 'the model'} is already quantized "
                          f"(quantization_config quant_method {method_name!r})")
    if method not in METHODS:
        raise KvslimError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    _check_smoothing(method, calib, smooth_alpha)
    if config.moe is not None:
        raise KvslimError(f"quantizing a mixture-of-experts model ({config.architecture}) is "
                          "not supported yet")
    family = family_of(config)
    if not family.scale_folding and (method == "awq" or smooth_alpha is not None):
        # both fold scales into the norm before each linear; the family file says why not
        raise KvslimError(f"--method {method}{' --smooth-alpha' if smooth_alpha else ''} does "
                          f"not support {family.name}'s norms yet; use gptq, rtn, int8 or plain "
                          "w8a8")
    if (method == "w8a8") != (spec.method == "w8a8"):
        raise KvslimError(f"--method {method} does not write a {spec.method} checkpoint")
    if bits not in (4, 8):
        raise KvslimError(f"--bits must be 4 or 8, got {bits}")
    sizes = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
             "num_attention_heads * head_dim": config.num_attention_heads * config.head_dim}
    for name, size in sizes.items():
        if group_size != -1 and (group_size <= 0 or size % group_size):
            raise KvslimError(f"--group-size {group_size} does not divide the input features of "
                              f"the model's linear layers ({name} = {size})")
    kv_out = min(config.kv_heads_per_layer) * config.head_dim
    if method != "w8a8" and any(k * config.head_dim % (32 // bits)
                                for k in config.kv_heads_per_layer):
        raise KvslimError(f"{bits}-bit packing needs output features divisible by {32 // bits}, "
                          f"the k/v projections have {kv_out}")
    if method in CALIBRATED and calib is None:
        raise KvslimError(f"--method {method} needs calibration text: --calib FILE")
    if method in ("rtn", "awq") and spec.desc_act:
        raise KvslimError(f"--act-order orders GPTQ's columns; --method {method} has none to order")


def _check_smoothing(method: str, calib, smooth_alpha: float | None) -> None:
    if smooth_alpha is not None and method != "w8a8":
        raise KvslimError(f"--smooth-alpha is SmoothQuant's, for --method w8a8, not {method}")
    if smooth_alpha is not None and not 0 <= smooth_alpha <= 1:
        raise KvslimError(f"--smooth-alpha must lie in [0, 1], got {smooth_alpha}")
    if smooth_alpha is not None and calib is None:
        raise KvslimError("--smooth-alpha needs calibration text: --calib FILE")
    if method == "w8a8" and smooth_alpha is None and calib is not None:
        raise KvslimError("--method w8a8 uses --calib only for SmoothQuant: add --smooth-alpha")


@torch.no_grad()
def layer0_inputs(model: CausalLM, windows: torch.Tensor, batch_size: int) -> list[tuple]:
    """The positional arguments decoder layer 0 receives, one tuple per batch of windows."""
    captured = []

    def grab(module, args):
        captured.append(args)
        raise _Captured

    hook = model.model.layers[0].register_forward_pre_hook(grab)
    try:
        for start in range(0, len(windows), batch_size):
            try:
                model(windows[start:start + batch_size])
            except _Captured:
                pass
    finally:
        hook.remove()
    return captured


@torch.no_grad()
def layer_hessian(layer: torch.nn.Module, linear: torch.nn.Module, inputs: list[tuple]) -> Hessian:
    hessian = Hessian(linear.in_features)
    hook = linear.register_forward_pre_hook(lambda module, args: hessian.add(args[0]))
    try:
        for args in inputs:
            layer(*args)
    finally:
        hook.remove()
    return hessian


@torch.no_grad()
def linear_inputs(layer: torch.nn.Module, inputs: list[tuple]) -> dict[str, torch.Tensor]:
    """Each of the layer's linears' inputs [n, in] while the layer runs on `inputs`."""
    seen = {sub: [] for sub in LINEARS}
    hooks = [layer.get_submodule(sub).register_forward_pre_hook(
        lambda module, args, sub=sub: seen[sub].append(args[0].reshape(-1, args[0].shape[-1])))
        for sub in LINEARS]
    try:
        for args in inputs:
            layer(*args)
    finally:
        for hook in hooks:
            hook.remove()
    return {sub: torch.cat(xs).float() for sub, xs in seen.items()}


@torch.no_grad()
def quantize_layers(model: CausalLM, spec: QuantSpec, windows: torch.Tensor | None,
                    batch_size: int = 4, show_progress: bool = True, method: str | None = None,
                    awq_clip: bool = True, smooth_alpha: float | None = None
                    ) -> dict[str, QuantizedWeight]:
    """Quantize every decoder linear in place (its weight becomes the dequantized one, so later
    layers see the quantized model); returns the quantized form by module name. RTN needs no
    `windows`; GPTQ, AWQ and SmoothQuant (W8A8 with `smooth_alpha`) need [N, T] token windows.
    `method` defaults to GPTQ with windows, RTN without; `awq_clip` adds AWQ's clipping search
    to its scales."""
    method = method or ("rtn" if windows is None else "gptq")
    inputs = layer0_inputs(model, windows, batch_size) if windows is not None else None
    norm_dtype = parse_dtype(model.config.torch_dtype)
    out = {}
    for i, layer in enumerate(tqdm(model.model.layers, desc="quantizing", unit="layer",
                                   disable=not show_progress)):
        if method == "awq":
            fold_layer(layer, linear_inputs(layer, inputs), spec.bits, spec.group_size,
                       spec.sym, norm_dtype)
        if method == "awq" and awq_clip:
            clip_layer(layer, linear_inputs(layer, inputs), spec.bits, spec.group_size, spec.sym)
        if method == "w8a8" and smooth_alpha is not None:
            smooth_layer(layer, linear_inputs(layer, inputs), smooth_alpha, norm_dtype)
        for sub in LINEARS:
            linear = layer.get_submodule(sub)
            if method == "w8a8":
                result = int8_per_channel(linear.weight)
            elif method in ("rtn", "awq"):
                result = rtn_quantize(linear.weight, spec.bits, spec.group_size, spec.sym)
            else:
                hessian = layer_hessian(layer, linear, inputs).matrix
                result = gptq_quantize(linear.weight, hessian, spec.bits, spec.group_size,
                                       spec.sym, spec.desc_act)
            linear.weight.copy_(result.dequantize().to(linear.weight.dtype))
            out[f"model.layers.{i}.{sub}"] = result
        if inputs is not None:
            inputs = [(layer(*args), *args[1:]) for args in inputs]
    return out


def quantized_state_dict(model: CausalLM, results: dict[str, QuantizedWeight],
                         spec: QuantSpec) -> dict[str, torch.Tensor]:
    """HF-named checkpoint tensors: each quantized matrix's GPTQ tensors in place of its
    weight (a fused one split into its checkpoint shards), everything else as it is."""
    fused = {hf_part: part_shard for hf_part, part_shard in model.packed_modules_mapping.items()}
    dtype = parse_dtype(model.config.torch_dtype)
    pack = pack_w8a8 if spec.method == "w8a8" else pack_gptq
    out = {}
    for name, tensor in model.hf_state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        parent, _, proj = prefix.rpartition(".")
        part, shard = fused.get(proj, (proj, None))
        module_name = f"{parent}.{part}"
        if module_name in results and leaf == "weight":
            module = model.get_submodule(module_name)
            rows = slice(None) if shard is None else module.shard_rows(shard)
            packed = pack(results[module_name].rows(rows), spec)
            out.update({f"{prefix}.{k}": v for k, v in packed.items()})
        else:
            out[name] = tensor.detach().to(dtype)
    return out


def quantize_model(src: str | Path, dst: str | Path, method: str, spec: QuantSpec,
                   calib: str | Path | None = None, calib_samples: int = 128,
                   seq_len: int = 512, show_progress: bool = True, awq_clip: bool = True,
                   smooth_alpha: float | None = None) -> Path:
    """Write `dst`: the model at `src` with its decoder linears quantized by `method`."""
    check_options(ModelConfig.from_dir(src), method, spec, calib, smooth_alpha)
    model = load_model(src, dtype=torch.float32)
    windows = None
    if method in CALIBRATED or smooth_alpha is not None:
        from kvslim.tokenizer.tokenizer import Tokenizer
        from kvslim.train.data import eval_windows, tokenize_file
        tokens = tokenize_file(calib, Tokenizer.from_dir(src), show_progress)
        windows = eval_windows(tokens, seq_len, calib_samples)[:, :seq_len]
    results = quantize_layers(model, spec, windows, show_progress=show_progress, method=method,
                              awq_clip=awq_clip, smooth_alpha=smooth_alpha)
    state = quantized_state_dict(model, results, spec)
    qcfg = spec.to_hf()             # GPTQ's layout for the 4/8-bit methods, W8A8's own
    raw = {**model.config.raw, "quantization_config": qcfg}
    return save_model(state, model.config.replace(raw=raw), dst, tokenizer_from=src)
