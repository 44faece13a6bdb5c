"""Linear layers holding llama.cpp's block-quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
in one decoded form, so a GGUF file's linear layers load without re-quantizing
(docs/quantization-formats.md, formats/gguf/blocks.py for the decoding; config.json's
`quantization_config` quant_method "gguf" names the file, `gguf_spec`):

    qvalues uint8 [out, in]        the integer of each weight (0..15, 0..31, 0..63 or 0..255)
    scales        [out, in / 16]   s of each group of 16 inputs
    mins          [out, in / 16]   m of each group
    qtype   int32 [shards]         each shard's GGML type id (`TYPE_IDS`)

w[o, i] = qvalues[o, i] * scales[o, i // 16] + mins[o, i // 16], llama.cpp's dequantization bit
for bit. Blocks run along the input dim, so every tensor is row-major over the outputs: fused
layers (q/k/v, gate/up) concatenate their shards' rows, and each shard keeps its own type (a
Q4_K_M file stores attn_v as Q6_K beside Q4_K q and k).

`prepare_for_inference` packs each run of 4-bit shards (Q4_0, Q4_1, Q4_K: 32 inputs share s and
m) and each run of 8-bit shards (Q5_0, Q8_0, Q6_K: w = (q - zero) * s) for kvslim's own group
kernel (kernels/tiled_gemm.py: float32 activations, each output's sums in one fixed order, so a
row's result does not depend on the batch); a layer whose shards are all one width runs one
kernel. Without the extension (no C++ compiler, KVSLIM_NO_EXTENSION=1) torch's kernels run
instead: `int4_linear` (bfloat16 activations, `pack_int4_offsets`) and the exact float32
`int8_group_linear` (int8_group_kernel.py), which are not batch-invariant."""
from __future__ import annotations

from functools import partial
from typing import Any, Hashable

import torch
import torch.nn.functional as F

from kvslim.errors import ConfigError
from kvslim.kernels import activations, tiled_gemm
from kvslim.quantization.base import QuantLinear, QuantSpec
from kvslim.quantization.gptq import _int4_forward
from kvslim.quantization.int8_group_kernel import int8_group_linear, pack_int8_group
from kvslim.quantization.kernels import pack_int4_offsets
from kvslim.quantization.registry import register

GROUP = 16                  # storage group: Q6_K's sub-block; the others repeat over 32
INT4_GROUP = 32
NATIVE_INT4_ROWS = 16
BLOCK_LEAVES = ("qvalues", "scales", "mins", "qtype", "bias")
# The types kept in blocks (formats/gguf/blocks.py decodes them): GGML type ids
# (gguf.GGMLQuantizationType) and the integer width their q values need.
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q8_0": 8, "Q6_K": 8}
# q - ZERO is the signed 8-bit value of the 8-bit types (w = s * (q - ZERO)).
ZERO = {"Q5_0": 16, "Q8_0": 128, "Q6_K": 32}
# The kernels' view, by the `qtype` id a shard stores: 4-bit types, 8-bit ones with their zero.
FOUR_BIT_TYPES = tuple(TYPE_IDS[kind] for kind, bits in BITS.items() if bits == 4)
EIGHT_BIT_ZEROS = {TYPE_IDS[kind]: zero for kind, zero in ZERO.items()}


def gguf_spec(cfg: dict[str, Any]) -> QuantSpec:
    """quant_method "gguf": kvslim's own config for a model whose weights stay in a GGUF file
    (`kvslim import-gguf` writes it)."""
    file = cfg.get("file")
    if not isinstance(file, str) or not file:
        raise ConfigError("config.json: quantization_config quant_method 'gguf' needs "
                          "'file', the GGUF file's name")
    return QuantSpec(4, 32, sym=False, checkpoint_format="gguf", method="gguf", file=file,
                     embedding=bool(cfg.get("embedding", False)),
                     lm_head=bool(cfg.get("lm_head", False)))


class BlockQuantLinear(QuantLinear):
    """A linear layer of decoded GGUF blocks; shards ("q"/"k"/"v", or "gate"/"up" also
    reachable as 0/1) are stacked along the output, row major."""
    LEAVES = BLOCK_LEAVES

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 spec: QuantSpec | None = None, shard_sizes: dict[Hashable, int] | None = None):
        super().__init__(in_features, out_features, bias, spec, shard_sizes)
        if in_features % INT4_GROUP:
            raise ConfigError(f"a GGUF block layer needs inputs divisible by {INT4_GROUP}, "
                              f"got {in_features}")
        out, groups = self.out_features, in_features // GROUP
        self.register_buffer("qvalues", torch.zeros(out, in_features, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out, groups))
        self.register_buffer("mins", torch.zeros(out, groups))
        self.register_buffer("qtype", torch.zeros(len(self.shard_sizes), dtype=torch.int32))

    @classmethod
    def input_multiple(cls, spec: QuantSpec) -> int:
        """The int4 kernel's group: a shard's blocks are cut at 32 inputs."""
        return INT4_GROUP

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] in the scales' dtype."""
        return dequantize_groups(self.qvalues, self.scales, self.mins)

    @torch.no_grad()
    def prepare_for_inference(self) -> None:
        """Choose the kernels (see the module docstring); off the CPU, one dense weight."""
        if self.qvalues.device.type != "cpu":
            dense = self.dequantized_weight()
            self.kernel = partial(_dense_forward, weight=dense, bias=self.bias)
            return
        self.kernel = block_kernel(self.qvalues, self.scales, self.mins, self.qtype.tolist(),
                                   list(self.shard_sizes.values()), self.bias)

    def shard_view(self, leaf: str, shard_id: Hashable) -> torch.Tensor:
        """The rows of buffer `leaf` that hold one shard, as a view; its entry of qtype."""
        if leaf == "qtype":
            i, _ = self._shard(shard_id)
            return self.qtype[i:i + 1]
        return super().shard_view(leaf, shard_id)


def block_kernel(qvalues: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 qtypes: list[int], sizes: list[int], bias: torch.Tensor | None):
    """x -> x @ w^T + bias for decoded blocks whose shards (row runs of `sizes`) have GGML types
    `qtypes`: one kernel per run of shards of one width, concatenated when there are several."""
    unknown = [t for t in qtypes if t not in (*FOUR_BIT_TYPES, *EIGHT_BIT_ZEROS)]
    if unknown:
        raise ConfigError(f"GGUF block weights of unsupported type id {unknown[0]}")
    zeros = torch.cat([torch.full((n,), EIGHT_BIT_ZEROS.get(t, 0), dtype=torch.int16,
                                  device=qvalues.device)
                       for t, n in zip(qtypes, sizes)])
    kernels = [_run_kernel(qvalues[rows], scales[rows], mins[rows], zeros[rows], four_bit)
               for rows, four_bit in _runs(qtypes, sizes)]
    if len(kernels) == 1:
        return partial(kernels[0], bias=bias)
    return partial(_concat_forward, kernels=kernels, bias=bias)


def _run_kernel(qvalues, scales, mins, zeros, four_bit: bool):
    """4-bit: w = q * s + m over the 32 inputs a 4-bit block's s and m cover, `int4_linear`
    (kvslim's group kernel inside, where it is built). 8-bit: w = (q - zero) * s, kvslim's
    group kernel over groups of 16, or of 32 where each pair of groups shares its scale (Q8_0,
    Q5_0: one scale per 32 bytes), else the exact float32 `int8_group_linear`."""
    extension = tiled_gemm.available()
    if not extension and qvalues.shape[0] % NATIVE_INT4_ROWS:
        # torch's int4 packing needs the outputs in multiples of 16 (a tiny vocabulary's
        # LM head may not be): dequantized once, exact.
        return partial(_dense_forward, weight=dequantize_groups(qvalues, scales, mins))
    if four_bit:
        weight = pack_int4_offsets(qvalues, scales[:, ::2].float(), mins[:, ::2].float(),
                                   INT4_GROUP)
        return partial(_int4_forward, weight=weight, perm=None)
    values = (qvalues.to(torch.int16) - zeros[:, None]).to(torch.int8)
    if not extension:
        return partial(_int8_group_forward, weight=pack_int8_group(values, scales.float(), GROUP))
    if torch.equal(scales[:, ::2], scales[:, 1::2]):
        scales = scales[:, ::2]
    return partial(activations.group_forward, weight=activations.pack(values, scales, None, 8))


def _runs(qtypes: list[int], sizes: list[int]) -> list[tuple[slice, bool]]:
    """Consecutive shards of one width as (rows, is 4-bit)."""
    runs: list[tuple[slice, bool]] = []
    start = 0
    for qtype, size in zip(qtypes, sizes):
        four = qtype in FOUR_BIT_TYPES
        if runs and runs[-1][1] == four:
            runs[-1] = (slice(runs[-1][0].start, start + size), four)
        else:
            runs.append((slice(start, start + size), four))
        start += size
    return runs


def dequantize_groups(qvalues: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
                      ) -> torch.Tensor:
    """q * s + m over groups of GROUP inputs: [rows, in] in the scales' dtype."""
    rows = qvalues.shape[0]
    q = qvalues.to(scales.dtype).view(rows, -1, GROUP)
    return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).view(rows, -1)


def _int8_group_forward(x, weight, bias=None):
    return int8_group_linear(x, weight, bias)


def _concat_forward(x: torch.Tensor, kernels, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.cat([k(x, bias=None) for k in kernels], dim=-1)
    return out if bias is None else out + bias.to(out.dtype)


def _dense_forward(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype), bias)


def gguf_config(spec: QuantSpec) -> dict[str, Any]:
    """The quantization_config `gguf_spec` reads back: the file, and which of the token
    embeddings and the LM head stay in its blocks."""
    cfg: dict[str, Any] = {"quant_method": "gguf", "file": spec.file}
    cfg.update({key: True for key in ("embedding", "lm_head") if getattr(spec, key)})
    return cfg


register("gguf", BlockQuantLinear, "gguf", gguf_spec, gguf_config)
