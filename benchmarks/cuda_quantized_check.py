"""Quantized weights on CUDA: int8 weights with int8 activations (W8A8, `torch._int_mm`) and
4-bit weights (RTN, GPTQ layout), against the same model in bfloat16, on the random ~1B Llama of
cuda_decode_check.py:

    python benchmarks/cuda_quantized_check.py --out docs/cuda_quantized_check.json
    python benchmarks/cuda_decode_check.py --quantized ...     # the same, inside the GPU check

For each engine (gather attention, CUDA graphs): start-up seconds, batch-1 decode tokens/s,
offline throughput (64 x 128 tokens in, 128 out), the checkpoint's bytes on disk, and how many
prompts of a mixed batch get the bfloat16 engine's greedy tokens (quantization changes the
numbers, so this is reported, not required) and how many get the same tokens alone as batched.

Before the engines, the kernels themselves (`kernel_check`), where a random-weight model's
tokens say little: each quantized linear on a 1B layer's shape against float32 arithmetic on
its dequantized weight (the largest error relative to the largest output), which kernel ran,
and whether the rows of a batch of 1, 8 and 64 get the bits one row alone gets.

Without CUDA it writes why it did not run, except with `--smoke`, which runs the tiny shapes on
the CPU."""
from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from cuda_check_common import (FULL, LLAMA_1B, LLAMA_SMOKE, SMOKE, build_engine, check_main,
                               count_equal_to_first, measure_engine, random_llama, release,
                               timed)
from kvslim_lab.bench.workload import Workload, special_ids
from kvslim.formats.registry import default_model_dir
from kvslim.quantization import QuantSpec
from kvslim.quantization.kernels import (int4_linear, pack_int4, quantize_per_token,
                                        w8a8_linear)
from kvslim.quantization.w8a8 import W8A8_SPEC
from kvslim.surgery.quantize.model import quantize_model
from kvslim.tokenizer.tokenizer import Tokenizer

VARIANTS = {"w8a8": ("w8a8", W8A8_SPEC),
            "int4-g32": ("rtn", QuantSpec(4, 32, sym=False, checkpoint_format="gptq_v2"))}


def disk_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def measure(name: str, model_dir: Path, plan: dict, prompts, check, device: str) -> dict:
    entry = {"weights": name, "disk_bytes": disk_bytes(model_dir)}
    try:
        llm, entry["startup_s"] = timed(device, lambda: build_engine(
            model_dir, "bfloat16", device, "gather", True, plan))
        entry.update(measure_engine(llm, prompts, check, plan, device))
        entry.pop("step_bytes", None)         # parameters only: a packed weight's buffers differ
        del llm
    except Exception as e:                    # the other variants' numbers survive
        traceback.print_exc()
        entry["error"] = f"{type(e).__name__}: {e}"
    release(device)
    print(f"[quantized] {name}: { {k: v for k, v in entry.items() if k != 'tokens'} }",
          file=sys.stderr, flush=True)
    return entry


def kernel_check(device: str, out_features: int = 2048, in_features: int = 2048) -> list[dict]:
    """Each quantized kernel on random codes: its error against float32 arithmetic on the
    dequantized weight, the path it took, and batch invariance of its rows."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, in_features, generator=gen).to(device, torch.bfloat16)
    results = []
    for group in (32, 128):
        values = torch.randint(0, 16, (out_features, in_features), generator=gen)
        scales = torch.rand(out_features, in_features // group, generator=gen) / 64 + 1e-3
        zeros = torch.randint(0, 16, scales.shape, generator=gen).float()
        packed = pack_int4(values.to(device), scales.to(device), zeros.to(device), group)
        path = ("kvslim group kernel" if packed.group is not None
                else "torch int4 op" if packed.native is not None else "dequantize + mm")
        results.append(_kernel_entry(f"int4-g{group}", path, x, lambda r: int4_linear(r, packed),
                                     packed.dequantize(torch.float32)))
    qweight = torch.randint(-127, 128, (out_features, in_features), generator=gen,
                            dtype=torch.int8).to(device)
    w_scales = (torch.rand(out_features, generator=gen) / 256 + 1e-4).to(device)
    path = "torch._int_mm" if device == "cuda" else "kvslim / torch._int_mm"
    results.append(_kernel_entry("w8a8", path, x, lambda r: w8a8_linear(r, qweight, w_scales),
                                 qweight.float() * w_scales[:, None].float(), per_token=True))
    return results


def _kernel_entry(name: str, path: str, x: torch.Tensor, linear, weight: torch.Tensor,
                  per_token: bool = False) -> dict:
    """One kernel's row of kernel_check. W8A8's reference quantizes the rows as it does."""
    got = linear(x).float()
    rows = x.float()
    if per_token:
        xq, sx = quantize_per_token(x)
        rows = xq.float() * sx
    want = rows @ weight.t()
    error = float((got - want).abs().max() / want.abs().max())
    alone = [linear(x[i:i + 1]) for i in range(8)]
    invariant = all(torch.equal(linear(x[:m])[:8], torch.cat(alone)) for m in (8, 64))
    return {"kernel": name, "path": path, "max_rel_error": round(error, 5),
            "rows_batch_invariant": invariant}


def check_quantized(smoke: bool = False, tokenizer_dir: Path | None = None) -> dict:
    """bfloat16 against W8A8 and int4 engines; {"skipped": why} without CUDA (unless
    `smoke`: then on the CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not smoke:
        return {"skipped": "no CUDA"}
    plan = SMOKE if smoke else FULL
    try:
        kernels = kernel_check(device)
    except Exception as e:                    # the engines' numbers survive
        traceback.print_exc()
        kernels = [{"error": f"{type(e).__name__}: {e}"}]
    print(f"[quantized] kernels: {kernels}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dense = random_llama(tokenizer_dir or default_model_dir(show_progress=False),
                             LLAMA_SMOKE if smoke else LLAMA_1B, device, root / "dense")
        vocab = json.loads((dense / "config.json").read_text())["vocab_size"]
        prompts = Workload(plan["batch"], plan["prompt_len"], 0, seed=1).prompts(
            vocab, special_ids(Tokenizer.from_dir(dense)))
        check = [p[:max(1, len(p) * (i + 1) // plan["check_prompts"])]
                 for i, p in enumerate(prompts[:plan["check_prompts"]])]
        entries = [measure("bfloat16", dense, plan, prompts, check, device)]
        for name, (method, spec) in VARIANTS.items():
            try:
                path, seconds = timed(device, lambda: quantize_model(
                    dense, root / name, method, spec, show_progress=False))
            except Exception as e:
                traceback.print_exc()
                entries.append({"weights": name, "error": f"{type(e).__name__}: {e}"})
                continue
            entries.append({**measure(name, path, plan, prompts, check, device),
                            "quantize_s": round(seconds, 1)})
    count_equal_to_first(entries, "prompts_equal_bf16")
    return {"model": "llama-tiny" if smoke else "llama-1B-random",
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "kernels": kernels, "engines": entries}


if __name__ == "__main__":
    sys.exit(check_main(check_quantized, __doc__.splitlines()[0]))
