"""compressed-tensors' sparse weight layouts, `sparse-bitmask` and `sparse-24-bitmask`
(docs/quantization-formats.md): each compressed weight's tensors, made dense as the loader reads
them (`dense_weights`), and a pruned model's checkpoint written in them (`sparse_checkpoint`,
for `kvslim prune --format compressed-tensors`). config.json's `sparsity_config` is parsed with
the rest of the quantization_config, when the config is read (quantization/compressed_tensors.py:
`sparsity_format`, below formats/).

Per compressed `<module>.weight` [rows, cols], bitmask = the nonzeros' places, 8 columns a byte,
the first column in the lowest bit (numpy's `packbits(..., bitorder="little")`), a row padded
with zero bits to whole bytes:

    sparse-bitmask      shape       int64 [2]               [rows, cols]
                        compressed  [nonzeros]              the nonzeros, row after row
                        bitmask     uint8 [rows, ceil(cols / 8)]
                        row_offsets int64 [rows]            where each row starts in `compressed`
    sparse-24-bitmask   shape       int64 [2, 1]
                        compressed  [rows, cols / 2]        two values of every 4 columns
                        bitmask     uint8 [rows, ceil(cols / 8)]

The values keep the weight's dtype: float for a float model, int8 codes for an int-quantized
(W8A8) one, whose `weight_scale` is stored beside as usual. 2:4 keeps exactly two places of
every group of 4; a group with fewer nonzeros keeps zeros as values, at the places
compressed-tensors' `get_24_bytemasks` picks: `topk(2)` of |w| over the group, whose choice
among equal (zero) values is torch's (`mask_24` makes the same call, so the bytes are the
library's; tested against compressed-tensors 0.12.2). Checked against compressed-tensors'
compressors/sparse_compressors/sparse_bitmask.py and sparse_24_bitmask.py (`bitmask_compress`,
`bitmask_decompress`, `sparse24_bitmask_compress`, `sparse24_bitmask_decompress`),
utils/helpers.py (`pack_bitmasks`, `unpack_bitmasks`) and base.py (every `.weight` of a targeted
module is compressed, after quantization)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from kvslim.errors import KvslimError, WeightsError
from kvslim.formats.compressed_tensors import from_gptq
from kvslim.formats.compressed_tensors_int import pack_w8a8
from kvslim.quantization.compressed_tensors import pack_config
from kvslim.formats.gptq import unpack_gptq
from kvslim.models.config import ModelConfig
from kvslim.quantization.base import QuantSpec
from kvslim.quantization.compressed_tensors import sparsity_format
from kvslim.quantization.w8a8 import W8A8_SPEC

SPARSE_24 = "sparse-24-bitmask"
SPARSE_BITMASK = "sparse-bitmask"
# Format -> the tensors one compressed weight is stored as, `<module>.<leaf>`.
LEAVES = {SPARSE_BITMASK: ("shape", "compressed", "bitmask", "row_offsets"),
          SPARSE_24: ("shape", "compressed", "bitmask")}
Stored = Iterator[tuple[Path, str, torch.Tensor]]
GPTQ_LEAVES = ("qweight", "qzeros", "scales", "g_idx")


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [rows, cols] -> uint8 [rows, ceil(cols / 8)], column j in bit j % 8 of byte j // 8."""
    rows, cols = mask.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.uint8)
    padded[:, :cols] = mask
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (padded.view(rows, -1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of `pack_bits` (padding bits ignored, as compressed-tensors does)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    unpacked = (bits.view(torch.uint8)[..., None] >> shifts) & 1
    return unpacked.reshape(bits.shape[0], -1)[:, :cols].bool()


def compress_bitmask(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """sparse-bitmask: one weight [rows, cols] as its tensors (leaf -> tensor)."""
    mask = weight != 0
    counts = mask.sum(dim=1)
    return {"shape": torch.tensor(list(weight.shape), dtype=torch.int64),
            "compressed": weight[mask].contiguous(),
            "bitmask": pack_bits(mask),
            "row_offsets": torch.cumsum(counts, 0) - counts}


def mask_24(weight: torch.Tensor) -> torch.Tensor:
    """The two places of every 4 consecutive columns that 2:4 keeps: the nonzeros, topped up
    with zeros where compressed-tensors' `get_24_bytemasks` puts them (its `topk(2)` of |w|,
    the same call). A group with more than two nonzeros cannot be stored without losing one.
    Integers are made absolute in int16 (|-128| does not fit int8)."""
    rows, cols = weight.shape
    if cols % 4:
        raise ValueError(f"2:4 needs columns divisible by 4, got {cols}")
    groups = weight.reshape(-1, 4)
    if bool(((groups != 0).sum(dim=1) > 2).any()):
        raise ValueError("a group of 4 columns has more than 2 nonzeros: not 2:4 sparse")
    scores = groups.abs() if groups.is_floating_point() else groups.to(torch.int16).abs()
    mask = torch.zeros(groups.shape, dtype=torch.bool)
    mask.scatter_(1, scores.topk(2, dim=1).indices, True)
    return mask.view(rows, cols)


def compress_24(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """sparse-24-bitmask: one 2:4 sparse weight [rows, cols] as its tensors."""
    rows, cols = weight.shape
    mask = mask_24(weight)
    return {"shape": torch.tensor([[rows], [cols]], dtype=torch.int64),
            "compressed": weight[mask].reshape(rows, cols // 2).contiguous(),
            "bitmask": pack_bits(mask)}


COMPRESS = {SPARSE_BITMASK: compress_bitmask, SPARSE_24: compress_24}


def decompress(fmt: str, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One weight's stored tensors (format `fmt`) -> the dense weight [rows, cols], every
    tensor's shape and the number of values checked against the others."""
    shape = parts["shape"]
    if shape.is_floating_point() or shape.numel() != 2:
        raise WeightsError(f"{prefix}.shape must hold 2 integers (rows, columns), got "
                           f"{shape.dtype} {list(shape.shape)}")
    rows, cols = (int(v) for v in shape.flatten())
    bits, values = parts["bitmask"], parts["compressed"]
    if bits.dtype not in (torch.uint8, torch.int8) or tuple(bits.shape) != (rows, -(-cols // 8)):
        raise WeightsError(f"{prefix}.bitmask is {bits.dtype} {list(bits.shape)}, expected uint8 "
                           f"{[rows, -(-cols // 8)]} for {prefix}.shape {[rows, cols]}")
    mask = unpack_bits(bits, cols)
    kept = int(mask.sum())
    want = (kept,) if fmt == SPARSE_BITMASK else (rows, cols // 2)
    if tuple(values.shape) != want or (fmt == SPARSE_24 and kept != values.numel()):
        raise WeightsError(f"{prefix}.compressed has shape {list(values.shape)}, but "
                           f"{prefix}.bitmask marks {kept} values ({list(want)} expected)")
    if fmt == SPARSE_BITMASK:
        counts = mask.sum(dim=1)
        offsets = parts["row_offsets"]
        if tuple(offsets.shape) != (rows,) or not torch.equal(
                offsets.long(), torch.cumsum(counts, 0) - counts):
            raise WeightsError(f"{prefix}.row_offsets disagrees with {prefix}.bitmask (each "
                               "row's first value in compressed)")
    dense = torch.zeros(rows, cols, dtype=values.dtype)
    dense[mask] = values.flatten()
    return dense


def stored_sparsity(config: ModelConfig) -> str | None:
    """The sparse format a checkpoint's weights are stored in: "sparse-bitmask",
    "sparse-24-bitmask", or None (none; "dense" sparsity metadata stores weights as usual)."""
    cfg = config.raw.get("quantization_config")
    if not isinstance(cfg, dict) or cfg.get("quant_method") != "compressed-tensors":
        return None
    fmt = sparsity_format(cfg)
    return fmt if fmt in LEAVES else None


def dense_weights(fmt: str, stored: Stored) -> Stored:
    """(file, name, tensor) of a checkpoint in sparse format `fmt` with each compressed weight
    replaced by `<module>.weight`, dense: a weight's tensors are collected until all have been
    read (they may sit in different shards); every other tensor passes through as stored."""
    leaves = set(LEAVES[fmt])
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for path, name, tensor in stored:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in leaves:
            yield path, name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if len(parts) == len(leaves):
            del pending[prefix]
            yield path, f"{prefix}.weight", decompress(fmt, prefix, parts)
    for prefix, parts in pending.items():
        missing = sorted(leaves - set(parts))
        raise WeightsError(f"missing weight '{prefix}.{missing[0]}' ({fmt} stores "
                           f"{', '.join(LEAVES[fmt])} per weight)")


def compress_weights(state: dict[str, torch.Tensor], fmt: str, names: set[str]
                     ) -> dict[str, torch.Tensor]:
    """The checkpoint `state` with each weight in `names` stored in sparse format `fmt`, in
    its place (compressed-tensors' key order: the leaves in `LEAVES`' order)."""
    out = {}
    for name, tensor in state.items():
        if name not in names:
            out[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        out.update({f"{prefix}.{leaf}": t for leaf, t in COMPRESS[fmt](tensor).items()})
    return out


def sparsity_config(fmt: str, structure: str, global_sparsity: float) -> dict:
    """config.json's `sparsity_config`, the fields compressed-tensors' `SparsityCompressionConfig`
    writes: every Linear but lm_head targeted."""
    return {"format": fmt, "global_sparsity": global_sparsity, "ignore": ["lm_head"],
            "registry_requires_subclass": False, "sparsity_structure": structure,
            "targets": ["Linear"]}


# ---- a pruned model's checkpoint (`kvslim prune --format compressed-tensors`) ---------------
def check_sparse_output(spec: QuantSpec | None) -> None:
    """Quantized kept weights are written int-quantized (8 bits: W8A8, one symmetric scale per
    output channel) or pack-quantized (4 bits)."""
    if spec is not None and spec.bits == 8 and (spec.group_size != -1 or not spec.sym):
        raise KvslimError("--format compressed-tensors with --bits 8 writes W8A8 "
                          "(int-quantized): it needs --group-size -1 and --sym")
    if spec is not None and spec.desc_act:
        raise KvslimError("--format compressed-tensors is written without act-order")


def sparse_checkpoint(state: dict[str, torch.Tensor], spec: QuantSpec | None, structure: str,
                      global_sparsity: float) -> tuple[dict[str, torch.Tensor], dict]:
    """A pruned model's checkpoint tensors as kvslim writes them otherwise (float, or the GPTQ
    layout for `spec`) -> the same weights in compressed-tensors' layouts, and config.json's
    quantization_config. Float and W8A8 weights (every decoder linear's, 2-D `.weight` under
    `model.layers.`) are bitmask-compressed, "sparse-24-bitmask" for `structure` "2:4",
    "sparse-bitmask" otherwise; 4-bit ones are packed (pack-quantized), which leaves no
    `.weight` to compress: the sparsity is recorded with format "dense", as compressed-tensors
    does."""
    check_sparse_output(spec)
    qcfg: dict = {"quant_method": "compressed-tensors"}
    if spec is not None:
        state, qcfg = _quantized(state, spec)
    fmt = SPARSE_24 if structure == "2:4" else SPARSE_BITMASK
    if spec is not None and spec.bits == 4:
        fmt = "dense"
    else:
        names = {name for name, t in state.items() if name.startswith("model.layers.")
                 and name.endswith(".weight") and t.dim() == 2}
        state = compress_weights(state, fmt, names)
    return state, {**qcfg, "sparsity_config": sparsity_config(fmt, structure, global_sparsity),
                   "transform_config": {}}


def _quantized(state: dict[str, torch.Tensor], spec: QuantSpec
               ) -> tuple[dict[str, torch.Tensor], dict]:
    """GPTQ-layout layers as int-quantized (8 bits) or pack-quantized (4 bits) ones."""
    out = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in GPTQ_LEAVES:
            if leaf == "qweight":
                layer = {k: state[f"{prefix}.{k}"] for k in GPTQ_LEAVES}
                packed = (pack_w8a8(unpack_gptq(layer, spec), W8A8_SPEC) if spec.bits == 8
                          else from_gptq(layer, spec))
                out.update({f"{prefix}.{k}": v for k, v in packed.items()})
            continue
        out[name] = tensor
    return out, W8A8_SPEC.to_hf() if spec.bits == 8 else pack_config(spec)
