"""`LoRALinear`: a model's linear with `max_loras` adapter slots beside it. Every token of a step
names its slot (`LoRABatch.token_slots`, -1: the base model alone), and one call per linear adds
each token's own adapter, B(A x), to the base output: Punica's SGMV idea, many adapters in one
batch without a merged copy per adapter (kernels/lora_sgmv.py: on the CPU a kernel whose every
row's numbers do not depend on the batch; a base-model row is not touched at all).

A layer that runs as one native call adds the same adapters inside it (kernels/decoder_layer.py).
A slot holds, for each of the layer's output shards (q/k/v, gate/up), an A [R, in] and a B
[rows, R] with the scaling folded in, zero-padded to R = max_lora_rank: a shard the adapter does
not train stays zero and adds zero."""
from __future__ import annotations

import torch
from torch import nn

from kvslim.kernels import lora_sgmv
from kvslim.kernels.lora_sgmv import lora_add_

# The decoder layers' linears adapters run on (attention and a dense MLP, under kvslim's names).
TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoRABatch:
    """What the step's linears read: each token's slot, or None when no token of the step has
    an adapter (the linears then run the base alone)."""

    def __init__(self):
        self.token_slots: torch.Tensor | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.batch = base, batch
        self.in_features, self.out_features = base.in_features, base.out_features
        self.shard_sizes = dict(getattr(base, "shard_sizes", None) or {None: base.out_features})
        self.rank = max_rank
        shards = len(self.shard_sizes)
        self.register_buffer("lora_a", torch.zeros(max_loras, shards * max_rank,
                                                   self.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank,
                                                   dtype=dtype, device=device))
        self.shard_rows = list(self.shard_sizes.values())

    def shard_key(self, shard_id):
        return self.base.shard_key(shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.batch.token_slots
        if slots is None:
            return y
        flat_y = y.reshape(-1, self.out_features)
        lora_add_(flat_y, x.reshape(-1, self.in_features), slots, self.lora_a, self.lora_b,
                  self.shard_rows)
        return flat_y.view(y.shape)

    @torch.no_grad()
    def set_slot(self, slot: int, shards: dict | None) -> None:
        """Slot `slot` holds these shards' (A, B) (a ModuleLoRA's), or nothing (zeros)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for key, (a, b) in (shards or {}).items():
            keys = list(self.shard_sizes) if key is None else [key]
            start = 0
            for j, (shard, rows) in enumerate(self.shard_sizes.items()):
                if shard in keys:
                    r = a.shape[0]
                    self.lora_a[slot, j * self.rank:j * self.rank + r] = a
                    source = b if key is not None else b[start:start + rows]
                    self.lora_b[slot, start:start + rows, :r] = source
                start += rows


def compute_dtype(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """What the model's activations are in (its float parameters' dtype: a quantized model's
    norms), and where: the adapters are kept so."""
    param = next(p for p in model.parameters() if p.is_floating_point())
    return param.dtype, param.device


def wrap_linears(model: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int
                 ) -> dict[str, LoRALinear]:
    """Every decoder layer's TARGETS wrapped (in place); kvslim module name -> its wrapper."""
    dtype, device = compute_dtype(model)
    lora_sgmv.available()                     # asked now, once, not inside a step
    wrapped = {}
    for i, layer in enumerate(model.model.layers):
        for target in TARGETS:
            parent_name, _, leaf = target.rpartition(".")
            parent = layer.get_submodule(parent_name)
            base = getattr(parent, leaf, None)
            if base is None or not hasattr(base, "in_features"):
                continue                        # e.g. a MoE layer's experts: no adapters
            lora = LoRALinear(base, batch, max_loras, max_rank, dtype, device)
            setattr(parent, leaf, lora)
            wrapped[f"model.layers.{i}.{target}"] = lora
        _attach_native(layer, [wrapped.get(f"model.layers.{i}.{t}") for t in TARGETS], batch)
    return wrapped


def _attach_native(layer: nn.Module, linears: list, batch: LoRABatch) -> None:
    """A layer that runs as one native call (kernels/decoder_layer.py) adds the same adapters
    there, after the same kernels, in the same order: the same bits as its modules."""
    native = getattr(layer, "native", None)
    if native is None:
        return
    if any(lin is None for lin in linears):
        layer.native = None                      # not every linear has slots: the modules run
        return
    from kvslim.kernels.decoder_layer import LayerAdapters
    native.lora = LayerAdapters(batch, [t for lin in linears for t in (lin.lora_a, lin.lora_b)],
                                [r for lin in linears for r in lin.shard_rows])
