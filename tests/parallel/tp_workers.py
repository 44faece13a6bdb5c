"""What each rank runs in the tensor-parallel forward tests (module-level, so that spawned
processes can import it). Each case loads the same full model on every rank, takes
its logits as the reference, shards it and takes them again: through the model's own dense
forward (DenseAttention), then once more after `prepare_for_inference` (the packed kernels),
against the full model after its own `prepare_for_inference` (a quantized model's kernels need
not equal its dequantized weights to the last bit, so the shard is held to what the full model
runs)."""
from __future__ import annotations

import copy

import torch

from kvslim.parallel import shard_model

LENGTHS = (20, 13, 6)                  # a left-padded batch of three prompts


def batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab_size, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, n in enumerate(LENGTHS):
        mask[row, max(LENGTHS) - n:] = True
    return ids, mask


def build(path: str) -> torch.nn.Module:
    """The full model the parent loaded and saved whole (`torch.save(model)`): a fresh
    process's first `load_model` pays about 2 s importing torch._dynamo (the meta-device
    initialisation goes through it), which on 2 cores shared by 4 ranks is most of a run."""
    return torch.load(path, weights_only=False)


@torch.inference_mode()
def parity(rank: int, world_size: int, cases: dict) -> dict[str, dict]:
    """Per case: the largest |sharded - full| logit, dense and after prepare_for_inference;
    the shard's local heads per layer; the logits' checksum (equal on every rank)."""
    out = {}
    for name, source in cases.items():
        model = build(source)
        ids, mask = batch(model.config.vocab_size)
        reference = model.logits(ids, mask)
        full = copy.deepcopy(model)
        full.prepare_for_inference()
        prepared_reference = full.logits(ids, mask)
        del full
        shard_model(model, rank, world_size)
        dense = model.logits(ids, mask)
        model.prepare_for_inference()
        prepared = model.logits(ids, mask)
        attn = [layer.self_attn for layer in model.model.layers]
        out[name] = {"dense": (dense - reference).abs().max().item(),
                     "prepared": (prepared - prepared_reference).abs().max().item(),
                     # what the full model's own kernels change (bfloat16 ones: ~1e-2),
                     # and the shard's kernels, from the same float32 logits
                     "kernel": (prepared_reference - reference).abs().max().item(),
                     "shard_kernel": (prepared - reference).abs().max().item(),
                     "scale": reference.abs().max().item(),
                     "shape": tuple(dense.shape) == tuple(reference.shape),
                     "heads": [(a.num_heads, a.num_kv_heads) for a in attn],
                     "checksum": dense.double().sum().item()}
    return out
