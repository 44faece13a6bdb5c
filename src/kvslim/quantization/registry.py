"""The quantization methods kvslim runs. Each method's file in this folder registers it once
when it is imported: the parser of its config.json `quantization_config` (by `quant_method`),
the layer class that holds one linear layer's weights in its form and the writer of its
`quantization_config` (both by `QuantSpec.method`): a method's file owns its format both ways.
Nothing imports a method before it is asked for (`parser`, `linear_class`): a model runs
with its own method's code only.

A new method is one file here that calls `register`, plus its line in `METHOD_MODULES`."""
from __future__ import annotations

import importlib
from typing import Any, Callable

# QuantSpec.method -> the file (in this folder) that registers it; in this order, the config
# quant_method names in QuantSpec.from_hf's error. A method parsed by another's parser (W8A8,
# by compressed-tensors') has no quant_method of its own.
METHOD_MODULES = {"gptq": "gptq", "awq": "awq", "compressed-tensors": "compressed_tensors",
                  "w8a8": "w8a8", "gguf": "gguf_blocks"}
QUANT_METHODS = ("gptq", "awq", "compressed-tensors", "gguf")

# config.json quant_method -> the function that reads that quantization_config as a QuantSpec
PARSERS: dict[str, Callable[[dict[str, Any]], Any]] = {}
# QuantSpec.method -> the QuantLinear subclass its layers are built as (`QuantSpec.make_linear`)
LINEARS: dict[str, type] = {}
# QuantSpec.method -> the function that writes its quantization_config (`QuantSpec.to_hf`); a
# method kvslim reads but never writes (AWQ) has none.
WRITERS: dict[str, Callable[[Any], dict[str, Any]]] = {}


def register(method: str, linear: type, quant_method: str | None = None,
             parse: Callable[[dict[str, Any]], Any] | None = None,
             write: Callable[[Any], dict[str, Any]] | None = None) -> None:
    """`method`'s layers are `linear`; `parse` reads configs whose quant_method is
    `quant_method`; `write` writes a spec of `method` back as one."""
    if method in LINEARS or quant_method in PARSERS:
        raise ValueError(f"quantization method {method!r} registered twice")
    LINEARS[method] = linear
    if write is not None:
        WRITERS[method] = write
    if quant_method is not None:
        PARSERS[quant_method] = parse


def _load(method: str) -> None:
    if method in METHOD_MODULES and method not in LINEARS:
        importlib.import_module(f"kvslim.quantization.{METHOD_MODULES[method]}")


def parser(quant_method: str) -> Callable[[dict[str, Any]], Any] | None:
    """The config parser of a quant_method, or None if kvslim has none."""
    _load(quant_method)
    return PARSERS.get(quant_method)


def writer(method: str) -> Callable[[Any], dict[str, Any]] | None:
    _load(method)
    return WRITERS.get(method)


def linear_class(method: str) -> type:
    _load(method)
    return LINEARS[method]


def linear_classes() -> tuple[type, ...]:
    """Every method's layer class, once each (several methods share GPTQ's)."""
    for method in METHOD_MODULES:
        _load(method)
    return tuple(dict.fromkeys(LINEARS.values()))
