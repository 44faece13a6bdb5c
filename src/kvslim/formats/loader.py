"""Load an HF-format model directory: config.json + safetensors (single file or sharded).

The model is built on the meta device, its parameters are then allocated once in their final
dtype and device, and each tensor read from the safetensors file is copied into its place
(`CausalLM.load_weights`), so no second full copy of the weights exists. Weights stored
sparse (compressed-tensors' bitmask layouts) are made dense as they are read."""
from __future__ import annotations

import importlib
import json
import sys
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvslim.errors import WeightsError
from kvslim.models.config import ModelConfig
from kvslim.dtypes import parse_dtype
from kvslim.models.families import family_of, model_class
from kvslim.models.causal_lm import CausalLM
from kvslim.layers.rope import RotaryEmbedding

# Buffers some older checkpoints saved that are recomputed from the config instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig, device: torch.device
                  ) -> torch.dtype:
    """'auto' (or None): float32 on CPU, where reduced-precision matmuls are slower, and the
    checkpoint's dtype (bfloat16 when it was float32) on accelerators."""
    if dtype not in (None, "auto"):
        return parse_dtype(dtype)
    if device.type == "cpu":
        return torch.float32
    stored = parse_dtype(config.torch_dtype)
    return torch.bfloat16 if stored == torch.float32 else stored


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors weights in {model_dir}")
    return files


def import_off_stack(module: str) -> None:
    """Import `module` in a thread of its own. Building a model under a device context
    imports torch._dynamo lazily, and a function it runs at import (torch.fx.wrap) leaves its
    frame in a reference cycle: imported from the caller's stack, that frame's f_back chain
    would keep the caller's locals (an LLM under construction, its KV pool) alive until the
    cycle collector happens to run."""
    if module not in sys.modules:
        thread = threading.Thread(target=importlib.import_module, args=(module,))
        thread.start()
        thread.join()


def load_model(model_dir: str | Path, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device = "cpu") -> CausalLM:
    model_dir = Path(model_dir)
    import_off_stack("torch._dynamo")
    config = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        model = model_class(config)(config)
    # Allocated once, uninitialised, in the final dtype and device; each checkpoint tensor is
    # then copied into its place (a row block of a fused parameter or a whole one).
    model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings and isinstance(model.model.embed_tokens, torch.nn.Embedding):
        model.lm_head.weight = model.model.embed_tokens.weight
    expected = {name: t.shape for name, t in model.hf_state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    spec = config.quantization
    weights = (_checked_gguf_weights(model_dir / spec.file, config, expected)
               if spec is not None and spec.method == "gguf"
               else _checked_weights(model_dir, config, expected))
    loaded = model.load_weights(weights)
    missing = sorted(set(expected) - loaded - _default_g_idx(model, config, set(expected) - loaded))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"missing weight {missing[0]!r}{more} in {model_dir}")
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset(device)
    return model.eval()


def _default_g_idx(model, config: ModelConfig, missing: set[str]) -> set[str]:
    """GPTQ checkpoints quantized without act-order may leave `g_idx` out: then input channel
    i is in group i // group_size. Fills those and returns their names."""
    spec = config.quantization
    names = {name for name in missing if name.endswith(".g_idx")}
    if spec is None or spec.desc_act or not names:
        return set()
    views = model.hf_state_dict()
    with torch.no_grad():
        for name in names:
            channels = torch.arange(views[name].numel(), device=views[name].device)
            views[name].copy_(channels // spec.group_size if spec.group_size > 0
                              else torch.zeros_like(channels))
    return names


def _checked_weights(model_dir: Path, config: ModelConfig, expected: dict[str, torch.Size]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint weight the model takes, each checked by name and
    shape against `expected` before it is read. Another tool's quantized layout is converted
    to the GPTQ layout first (formats/quant_layouts.py) and checked after."""
    spec, family = config.quantization, family_of(config)
    if spec is not None and family.quantized_unsupported:
        raise WeightsError(f"{model_dir}: quantized {config.architecture} checkpoints are not "
                           f"supported yet ({family.quantized_unsupported})")
    # Other tools' quantized and sparse layouts: read by this, the safetensors path, only.
    from kvslim.formats.quant_layouts import LAYOUTS, gptq_weights
    entries = _entries(model_dir, config)
    if spec is not None and spec.method in LAYOUTS:
        stored = ((path, name, read()) for path, name, _, read in entries)
        for path, name, tensor in gptq_weights(spec, stored, expected):
            _check(path, name, tuple(tensor.shape), config, expected)
            yield name, tensor
        return
    for path, name, shape, read in entries:
        if family.translates(name):                  # e.g. Phi-3's fused qkv_proj
            for part, tensor in family.from_checkpoint(name, read(), config):
                _check(path, part, tuple(tensor.shape), config, expected)
                yield part, tensor
            continue
        _check(path, name, shape, config, expected)
        yield name, read()


def _entries(model_dir: Path, config: ModelConfig) -> Iterator[tuple[Path, str, tuple, Any]]:
    """(file, name, shape, read) for every weight the loader reads, `read()` giving the tensor:
    read lazily, after its shape is checked, unless the checkpoint stores weights sparse
    (compressed-tensors' bitmask layouts), whose tensors are read and made dense first."""
    from kvslim.formats.compressed_tensors_sparse import dense_weights, stored_sparsity
    fmt = stored_sparsity(config)
    if fmt is None:
        for path, f, name in _stored(model_dir, config):
            yield path, name, tuple(f.get_slice(name).get_shape()), partial(f.get_tensor, name)
        return
    stored = ((path, name, f.get_tensor(name)) for path, f, name in _stored(model_dir, config))
    for path, name, tensor in dense_weights(fmt, stored):
        yield path, name, tuple(tensor.shape), partial(lambda t: t, tensor)


def _stored(model_dir: Path, config: ModelConfig) -> Iterator[tuple[Path, Any, str]]:
    """(file, open safetensors file, name) for every stored tensor the loader reads."""
    from kvslim.formats.compressed_tensors_int import is_symmetric_zero_point
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings
                                                       and name == "lm_head.weight"):
                    continue
                if is_symmetric_zero_point(config.quantization, name, lambda: f.get_tensor(name)):
                    continue
                yield path, f, name


def _checked_gguf_weights(path: Path, config: ModelConfig, expected: dict[str, torch.Size]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The same from a GGUF file (quantization_config quant_method "gguf")."""
    from kvslim.formats.gguf.weights import gguf_weights
    if not path.is_file():
        raise WeightsError(f"config.json names GGUF file {path.name!r}, which is not in "
                           f"{path.parent}")
    for name, tensor in gguf_weights(path, config):
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        _check(path, name, tuple(tensor.shape), config, expected)
        yield name, tensor


def _check(path: Path, name: str, shape: tuple[int, ...], config: ModelConfig,
           expected: dict[str, torch.Size]) -> None:
    if name not in expected:
        raise WeightsError(f"{path.name}: unexpected weight {name!r} for {config.architecture}")
    if shape != tuple(expected[name]):
        raise WeightsError(f"{path.name}: weight {name!r} has shape {list(shape)}, "
                           f"expected {list(expected[name])} from config.json")


def init_model(config: ModelConfig, seed: int = 0, std: float = 0.02,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
               ) -> CausalLM:
    """A freshly initialised model (normal(0, std) linears and embeddings, unit norms). Values
    are drawn per HF-named tensor in checkpoint order, so a fused parameter gets the same
    values its separate checkpoint matrices would."""
    gen = torch.Generator().manual_seed(seed)
    model = model_class(config)(config)
    with torch.no_grad():
        for name, p in model.hf_state_dict().items():
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue                     # the embedding matrix, drawn already
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.to(device=device, dtype=dtype)
