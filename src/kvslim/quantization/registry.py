"""The quantization methods kvslim runs. Each method's file in this folder registers it once
(the package's `__init__` imports them all, so the tables are full whenever anything here is
imported): the parser of its config.json `quantization_config` (by `quant_method`) and the
layer class that holds one linear layer's weights in its form (by `QuantSpec.method`).

A new method is one file here that calls `register`, plus its line in `__init__.py`."""
from __future__ import annotations

from typing import Any, Callable

# config.json quant_method -> the function that reads that quantization_config as a QuantSpec
PARSERS: dict[str, Callable[[dict[str, Any]], Any]] = {}
# QuantSpec.method -> the QuantLinear subclass its layers are built as (`QuantSpec.make_linear`)
LINEARS: dict[str, type] = {}


def register(method: str, linear: type, quant_method: str | None = None,
             parse: Callable[[dict[str, Any]], Any] | None = None) -> None:
    """`method`'s layers are `linear`; `parse` reads configs whose quant_method is
    `quant_method` (a method parsed by another's parser, as W8A8 by compressed-tensors', has
    none)."""
    if method in LINEARS or quant_method in PARSERS:
        raise ValueError(f"quantization method {method!r} registered twice")
    LINEARS[method] = linear
    if quant_method is not None:
        PARSERS[quant_method] = parse


def linear_classes() -> tuple[type, ...]:
    """Every registered layer class, once each (several methods share GPTQ's)."""
    return tuple(dict.fromkeys(LINEARS.values()))
