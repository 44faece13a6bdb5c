"""The GGUF architectures kvslim reads and writes, gathered from the families' layouts (each
family's file in models/ holds its `GGUFLayout`: the tensor names of a layer, whether llama.cpp's
converter permuted the Q/K rows, its other quirks). Several families can share one GGUF
architecture — Llama, Mistral and Mixtral are all `llama` files, Mixtral's with experts
(formats/gguf/moe.py) — so the tensor tables here are per GGUF architecture, merged."""
from __future__ import annotations

from kvslim.models.base import Family
from kvslim.models.families import FAMILIES

_WITH_LAYOUT = [f for f in FAMILIES if f.gguf is not None]


def _merged_tables() -> dict[str, dict[str, str]]:
    tables: dict[str, dict[str, str]] = {}
    for family in _WITH_LAYOUT:
        table = tables.setdefault(family.gguf.arch, {})
        for gguf_name, module in family.gguf.layer_tensors.items():
            if table.setdefault(gguf_name, module) != module:
                raise AssertionError(f"{family.name}: {gguf_name} is {table[gguf_name]} in "
                                     f"another {family.gguf.arch} family")
    return tables


# GGUF architecture -> its layer tensors (blk.N.<name>) -> kvslim's module names
LAYER_TENSORS = _merged_tables()
# the GGUF architectures import-gguf reads, in the families' order
SUPPORTED_GGUF_ARCHITECTURES = tuple(dict.fromkeys(f.gguf.arch for f in _WITH_LAYOUT
                                                   if f.gguf.imports))
# kvslim model type -> the GGUF architecture export-gguf writes (Mistral runs as llama)
EXPORT_ARCHITECTURES = {f.model_type: f.gguf.arch for f in _WITH_LAYOUT if f.supports_gguf_export}


def gguf_family(arch: str, experts: bool) -> Family | None:
    """The family a file of `arch` imports as, with experts (`{arch}.expert_count`) or without."""
    return next((f for f in _WITH_LAYOUT if f.gguf.imports and f.gguf.arch == arch
                 and f.gguf.experts == experts), None)


def permutes_qk(arch: str) -> bool:
    return any(f.gguf.permutes_qk for f in _WITH_LAYOUT if f.gguf.arch == arch)
