"""How far a tensor-parallel shard's logits are from one device's, with and without the CPU
kernels: the check behind docs/tensor-parallel.md's quantized section.

    python benchmarks/tensor_parallel_logits.py [--model default] [--quantized] --degree 3 --json

Every rank loads the same model and takes its logits for a fixed batch: through the dense
forward with the weights dequantized to float32, and after `prepare_for_inference` (the int4,
int8 and W8A8 kernels a quantized model runs). Then it shards the model and takes both again.
Reported (rank 0's; every rank ends with the same logits): |shard - full| on each path, and
|full prepared - full float32|, what the kernels alone change."""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvslim.formats.loader import load_model
from kvslim.formats.registry import resolve_model
from kvslim.parallel import shard_model


def _batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (3, 20), generator=torch.Generator().manual_seed(7))


@torch.inference_mode()
def _rank(rank: int, world_size: int, model_dir: str, workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    try:
        model = load_model(model_dir, dtype=torch.float32)
        ids = _batch(model.config.vocab_size)
        full = model.logits(ids)
        prepared_model = copy.deepcopy(model)
        prepared_model.prepare_for_inference()
        full_prepared = prepared_model.logits(ids)
        del prepared_model
        shard_model(model, rank, world_size)
        shard = model.logits(ids)
        model.prepare_for_inference()
        shard_prepared = model.logits(ids)
        figures = {"logit_scale": full.abs().max().item(),
                   "float32_shard_vs_full": (shard - full).abs().max().item(),
                   "kernels_shard_vs_full": (shard_prepared - full_prepared).abs().max().item(),
                   "kernels_vs_float32_full": (full_prepared - full).abs().max().item(),
                   "argmax_equal_fraction": (shard_prepared.argmax(-1) == full_prepared.argmax(-1)
                                             ).float().mean().item()}
        if rank == 0:
            Path(workdir, "result.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--quantized", action="store_true",
                   help="GGUF models: the quantized import (blocks kept)")
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model, quantized=args.quantized)
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_rank, args=(args.degree, str(model_dir), workdir),
                           nprocs=args.degree, start_method="spawn")
        figures = json.loads(Path(workdir, "result.json").read_text())
    result = {"model": str(model_dir), "degree": args.degree, **figures}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:<28} {value:.3g}" if isinstance(value, float) else f"{key:<28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
