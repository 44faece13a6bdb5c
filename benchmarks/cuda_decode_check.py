"""The one prepared GPU check of the engine's CUDA path: correctness and speed in one run.

    python benchmarks/cuda_decode_check.py --out docs/cuda_decode_check.json [--hbm-gbps 4800]
    python benchmarks/cuda_decode_check.py --smoke --out /tmp/check.json   # any machine, tiny

(`--models smollm2` or `--models llama` checks one model, to split the run in two; `--sparse24`
adds benchmarks/cuda_sparse24_check.py's comparison of 2:4 semi-structured sparse linears,
`--quantized` benchmarks/cuda_quantized_check.py's int8 (W8A8) and int4 weight engines.
`--config-from DIR` takes SmolLM2's config and tokenizer from DIR and gives it random float32
weights: for a machine that cannot hold the embedded GGUF, such as a GPU reached by copying a
working tree; its speeds are SmolLM2's, its tokens are not.)

On each model, SmolLM2-135M-Instruct (the embedded GGUF's float32 import) and a ~1B-parameter
Llama shape with random weights in bfloat16 (Llama 3.2 1B's layers over SmolLM2's vocabulary and
tokenizer), four engines: gather and flex attention, each eager (`enforce_eager`) and with CUDA
graphs captured at start-up; on the 1B model a fifth, gather with the decode step compiled
(`compile_decode`: Inductor's fused Triton kernels) inside the graphs. For each:

- greedy tokens of a mixed batch, against the eager gather engine's (the reference); exit
  status 1 when they differ on a float32 model (a bfloat16 model's differences are reported:
  kernels that sum in another order may round a near-tie the other way);
- whether each prompt of that batch gets the same greedy tokens alone (batch invariance);
- batch-1 decode tokens/s (the median of the engine's steps, timed one by one), and the HBM
  bandwidth that reaches: bytes a decode step reads (every weight once, plus the KV cache at
  the mean context) over the step's time, against the device's peak (`--hbm-gbps`, 4800 for
  an H200);
- on the graphs engines, where a batch-1 step goes (benchmarks/cuda_step_profile.py: host
  phases, device-busy time and its idle gap, launches, syncs, the costliest kernels;
  `--trace-dir DIR` keeps the Chrome traces);
- offline throughput: 64 prompts of 128 tokens, 128 generated each, as one batch;
- start-up seconds (graph capture and FlexAttention's compilation happen there).

Then HF transformers on the same model and dtype: batch-1 decode and the same offline workload at
its best static batch size (16, 32 or 64). A table goes to stdout, every number to `--out`
(rewritten after each model, so a run cut short keeps what it measured).

`--smoke` runs the same code with tiny shapes (4 tokens, batches of 4, a 2-layer Llama) on
whatever device there is; without CUDA the "graphs" engines run the padded static-buffer path
eagerly, and the HBM and HF parts are skipped (said so in the output)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from kvslim_lab.bench.attention_report import gpu_table
from kvslim_lab.bench.peer_hf import HFPeer
from kvslim_lab.bench.workload import Workload, special_ids
from kvslim.errors import ConfigError
from kvslim.formats.registry import default_model_dir
from kvslim.models.config import ModelConfig
from kvslim.tokenizer.tokenizer import Tokenizer

from cuda_check_common import (COMPILED, ENGINES, FULL, LLAMA_1B, LLAMA_SMOKE, SMOKE, hbm,
                               random_llama, release, run_engines)


def run_hf(model_dir: Path, dtype: str, device: str, prompts, plan: dict,
           hbm_gbps: float, step_bytes: int | None) -> dict:
    """HF transformers: batch-1 decode, and the offline workload at its best batch size."""
    if device != "cuda":
        return {"skipped": "no CUDA: HF transformers is measured on the GPU only"}
    try:
        hf = HFPeer(model_dir, getattr(torch, dtype), device)
        n = plan["new_tokens"]
        hf.generate(prompts[:2], 4, 2)                               # warm-up
        _, tpot = hf.latency(prompts[:1], n)
        entry = {"label": hf.label, "decode_tok_s": round(1 / tpot, 1)}
        if step_bytes:
            hbm(entry, step_bytes, hbm_gbps, device)
        rates = {b: len(prompts) * n / hf.generate(prompts, n, b) for b in plan["hf_batches"]}
        best = max(rates, key=rates.get)
        entry.update(throughput_tok_s=round(rates[best], 1), best_batch=best,
                     throughput_by_batch={b: round(r, 1) for b, r in rates.items()})
        del hf
        return entry
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        release(device)


def check_model(name: str, model_dir: Path, dtype: str, device: str, plan: dict,
                hbm_gbps: float, trace_dir: Path | None = None) -> dict:
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    avoid = special_ids(Tokenizer.from_dir(model_dir))
    prompts = Workload(plan["batch"], plan["prompt_len"], 0, seed=1).prompts(vocab, avoid)
    # The check batch: prompts of different lengths, so steps mix decodes and prefill chunks.
    check = [p[:max(1, len(p) * (i + 1) // plan["check_prompts"])]
             for i, p in enumerate(prompts[:plan["check_prompts"]])]
    engines = run_engines(model_dir, dtype, device, prompts, check, plan, hbm_gbps, trace_dir,
                          ENGINES + ([COMPILED] if dtype == "bfloat16" else []))
    step_bytes = next((e["step_bytes"] for e in engines if "step_bytes" in e), None)
    return {"model": name, "dtype": dtype, "strict": dtype == "float32", "engines": engines,
            "hf": run_hf(model_dir, dtype, device, prompts, plan, hbm_gbps, step_bytes)}


def failed(report: dict) -> bool:
    """A float32 model whose engines disagree, or any engine that did not run."""
    return any("error" in e or (m["strict"] and not e["tokens_identical"])
               for m in report["models"] for e in m["engines"])


SMOLLM2_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                      "rope_theta", "rms_norm_eps", "tie_word_embeddings")


def smollm2_source(config_from: Path | None) -> Path:
    """The directory whose tokenizer (and, with `config_from`, config) the models take."""
    return config_from if config_from is not None else default_model_dir(show_progress=False)


def models_to_check(args, device: str, root: Path, notes: list[str]):
    """(name, directory, dtype) of each model asked for; SmolLM2's import (or `--config-from`)
    is needed for both (its tokenizer serves the random Llama)."""
    try:
        smollm2 = smollm2_source(args.config_from)
    except ConfigError as e:
        notes.append(f"skipped every model: {e}")
        return
    if "smollm2" in args.models and args.config_from is not None:
        config = json.loads((smollm2 / "config.json").read_text())
        shape = {k: config[k] for k in SMOLLM2_SHAPE_KEYS if k in config}
        notes.append(f"SmolLM2's shape from {smollm2} with random float32 weights")
        yield "SmolLM2-135M-random", random_llama(smollm2, shape, device, root / "smollm2",
                                                  torch.float32), "float32"
    elif "smollm2" in args.models:
        yield "SmolLM2-135M", smollm2, "float32"
    if "llama" in args.models:
        shape, name = (LLAMA_SMOKE, "llama-tiny") if args.smoke else (LLAMA_1B, "llama-1B-random")
        yield name, random_llama(smollm2, shape, device, root / name), "bfloat16"


def extra_checks(args, report: dict) -> None:
    """The optional quantized and 2:4 sparse checks, each saved as soon as it is measured."""
    checks = []
    if args.quantized:
        from cuda_quantized_check import check_quantized
        checks.append(("quantized", check_quantized))
    if args.sparse24:
        from cuda_sparse24_check import check_sparse24
        checks.append(("sparse24", check_sparse24))
    for key, check in checks:
        try:
            report[key] = check(args.smoke, smollm2_source(args.config_from))
        except Exception as e:       # one check failing must not lose the others' numbers
            traceback.print_exc()
            report[key] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(report[key], indent=2))
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0,
                    help="the device's peak memory bandwidth, GB/s (default: H200's 4800)")
    ap.add_argument("--out", type=Path, default=None, help="write every number here (JSON)")
    ap.add_argument("--sparse24", action="store_true",
                    help="also compare cuda_sparse_24 with the dense kernels on the random Llama "
                         "pruned 2:4 (benchmarks/cuda_sparse24_check.py)")
    ap.add_argument("--quantized", action="store_true",
                    help="also run int8 (W8A8) and int4 weight engines on the random Llama "
                         "(benchmarks/cuda_quantized_check.py)")
    ap.add_argument("--config-from", type=Path, default=None,
                    help="SmolLM2's config.json and tokenizer from this directory, its weights "
                         "random (where the embedded GGUF cannot be had)")
    ap.add_argument("--trace-dir", type=Path, default=None,
                    help="also write each profiled engine's Chrome trace here")
    ap.add_argument("--models", default="smollm2,llama",
                    help="which of smollm2, llama (the random ~1B Llama) to check (default both)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = SMOKE if args.smoke else FULL
    notes = [f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch "
             f"{torch.__version__}; peak bandwidth taken as {args.hbm_gbps:g} GB/s"]
    if device != "cuda":
        notes.append("no CUDA: 'graphs' engines ran the padded decode path without CUDA graphs; HBM "
                     "fractions and HF transformers skipped")
    report = {"command": "python benchmarks/cuda_decode_check.py " + " ".join(sys.argv[1:]),
              "smoke": args.smoke, "device": device, "hbm_gbps": args.hbm_gbps, "plan": plan,
              "models": [], "notes": notes}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir, dtype in models_to_check(args, device, Path(tmp), notes):
            report["models"].append(check_model(name, model_dir, dtype, device, plan,
                                                args.hbm_gbps, args.trace_dir))
            if args.out:
                args.out.write_text(json.dumps(report, indent=2) + "\n")
    extra_checks(args, report)
    print(gpu_table(report))
    return 1 if failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
