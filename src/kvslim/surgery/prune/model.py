"""Prune a whole model (`kvslim prune`): every decoder linear in order — per decoder layer
q/k/v, o, gate/up, down — each on the inputs the already-pruned layers before it produce, as
quantization does (`quantize/model.py`, whose capture and Hessian hooks this reuses). Magnitude
needs no calibration; Wanda reads the inputs' norms (the Hessian's diagonal); SparseGPT the
whole Hessian. With `bits`, the kept weights are quantized too: SparseGPT jointly (one pass,
rounding errors fed forward with the pruning errors), magnitude and Wanda by round-to-nearest
after pruning (a pruned weight lands on the grid's zero point: exactly zero). Written dense
(float, loads in transformers) or, with `bits`, in the GPTQ layout; config.json records the
pruning (`kvslim_pruning`), so a pruned model is not pruned again. `output_format`
"compressed-tensors" writes the same weights in compressed-tensors' sparse layouts instead
(formats/compressed_tensors_sparse.py: bitmask-compressed, W8A8 with 8 bits, pack-quantized with
4)."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from kvslim.errors import KvslimError
from kvslim.formats.compressed_tensors_sparse import check_sparse_output, sparse_checkpoint
from kvslim.formats.gptq import QuantizedWeight
from kvslim.formats.loader import load_model
from kvslim.formats.writer import save_model
from kvslim.models.config import PRUNING_KEY, ModelConfig
from kvslim.dtypes import parse_dtype
from kvslim.models.causal_lm import CausalLM
from kvslim.quantization import QuantSpec
from kvslim.surgery.prune.masks import SparsityTarget, pruned_mask, wanda_scores
from kvslim.surgery.prune.sparsegpt import sparsegpt_prune
from kvslim.surgery.quantize.model import (LINEARS, check_options, layer0_inputs,
                                           layer_hessian, quantized_state_dict)
from kvslim.surgery.quantize.rtn import rtn_quantize

METHODS = ("magnitude", "wanda", "sparsegpt")
OUTPUT_FORMATS = ("dense", "compressed-tensors")
CONFIG_KEY = PRUNING_KEY


def check_prune_options(config: ModelConfig, method: str, target: SparsityTarget,
                        calib: str | Path | None, spec: QuantSpec | None) -> None:
    if CONFIG_KEY in config.raw:
        raise KvslimError(f"{config.source or 'the model'} is already pruned "
                          f"({config.raw[CONFIG_KEY]})")
    if method not in METHODS:
        raise KvslimError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    if method != "magnitude" and calib is None:
        raise KvslimError(f"--method {method} needs calibration text: --calib FILE")
    if spec is not None:       # the quantizer's checks: not quantized yet, groups that fit
        check_options(config, "rtn", spec, calib)
    elif config.raw.get("quantization_config") is not None:
        raise KvslimError(f"{config.source or 'the model'} is already quantized: prune the "
                          "float model (and quantize with --bits)")
    if config.moe is not None:
        raise KvslimError(f"pruning a mixture-of-experts model ({config.architecture}) is not "
                          "supported yet")
    if target.structured:
        sizes = {"hidden_size": config.hidden_size,
                 "intermediate_size": config.intermediate_size,
                 "num_attention_heads * head_dim": config.num_attention_heads * config.head_dim}
        for name, size in sizes.items():
            if size % target.m:
                raise KvslimError(f"--pattern {target} needs input features divisible by "
                                  f"{target.m}; the model's linear layers have {name} = {size}")
            if spec is not None and spec.group_size != -1 and spec.group_size % target.m:
                raise KvslimError(f"--group-size {spec.group_size} must be a multiple of M = "
                                  f"{target.m}")


def prune_linear(weight: torch.Tensor, method: str, target: SparsityTarget,
                 hessian: torch.Tensor | None, spec: QuantSpec | None
                 ) -> tuple[torch.Tensor, QuantizedWeight | None]:
    """One weight [out, in] pruned (and quantized): the new float weight, and its codes."""
    if method == "sparsegpt":
        return sparsegpt_prune(weight, hessian, target, None if spec is None else spec.bits,
                               spec.group_size if spec else 128, spec.sym if spec else True)
    scores = weight.abs().float() if method == "magnitude" else wanda_scores(
        weight, hessian.diagonal())
    pruned = torch.where(pruned_mask(scores, target), 0.0, weight.float())
    if spec is None:
        return pruned, None
    quantized = rtn_quantize(pruned, spec.bits, spec.group_size, spec.sym)
    return quantized.dequantize().float(), quantized


@torch.no_grad()
def prune_layers(model: CausalLM, method: str, target: SparsityTarget,
                 windows: torch.Tensor | None, spec: QuantSpec | None = None,
                 batch_size: int = 4, show_progress: bool = True
                 ) -> dict[str, QuantizedWeight]:
    """Prune every decoder linear in place; with `spec`, also quantize, returning the codes by
    module name. Magnitude needs no `windows`; the others [N, T] calibration windows."""
    inputs = layer0_inputs(model, windows, batch_size) if windows is not None else None
    out = {}
    for i, layer in enumerate(tqdm(model.model.layers, desc=f"pruning ({method}, {target})",
                                   unit="layer", disable=not show_progress)):
        for sub in LINEARS:
            linear = layer.get_submodule(sub)
            hessian = (None if method == "magnitude"
                       else layer_hessian(layer, linear, inputs).matrix)
            weight, quantized = prune_linear(linear.weight, method, target, hessian, spec)
            linear.weight.copy_(weight.to(linear.weight.dtype))
            if quantized is not None:
                out[f"model.layers.{i}.{sub}"] = quantized
        if inputs is not None:
            inputs = [(layer(*args), *args[1:]) for args in inputs]
    return out


def prune_model(src: str | Path, dst: str | Path, method: str, target: SparsityTarget,
                spec: QuantSpec | None = None, calib: str | Path | None = None,
                calib_samples: int = 128, seq_len: int = 512,
                show_progress: bool = True, output_format: str = "dense") -> Path:
    """Write `dst`: the model at `src` with its decoder linears pruned (and quantized)."""
    if output_format not in OUTPUT_FORMATS:
        raise KvslimError(f"unknown --format {output_format!r}; choose one of "
                          f"{', '.join(OUTPUT_FORMATS)}")
    if output_format == "compressed-tensors":
        check_sparse_output(spec)
    check_prune_options(ModelConfig.from_dir(src), method, target, calib, spec)
    model = load_model(src, dtype=torch.float32)
    windows = None
    if method != "magnitude":
        from kvslim.tokenizer.tokenizer import Tokenizer
        from kvslim.train.data import eval_windows, tokenize_file
        tokens = tokenize_file(calib, Tokenizer.from_dir(src), show_progress)
        windows = eval_windows(tokens, seq_len, calib_samples)[:, :seq_len]
    results = prune_layers(model, method, target, windows, spec, show_progress=show_progress)
    record = {"method": method, "sparsity": round(target.fraction, 4),
              "pattern": f"{target.n}:{target.m}" if target.structured else None}
    raw = {**model.config.raw, CONFIG_KEY: record}
    if spec is None:
        dtype = parse_dtype(model.config.torch_dtype)
        state = {k: v.detach().to(dtype) for k, v in model.hf_state_dict().items()}
    else:
        state = quantized_state_dict(model, results, spec)
        raw["quantization_config"] = spec.to_hf()
    if output_format == "compressed-tensors":
        state, raw["quantization_config"] = sparse_checkpoint(
            state, spec, record["pattern"] or "unstructured", record["sparsity"])
    return save_model(state, model.config.replace(raw=raw), dst, tokenizer_from=src)
