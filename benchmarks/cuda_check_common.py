"""What the prepared GPU checks share (benchmarks/cuda_decode_check.py and the checks it can
add, cuda_quantized_check.py and cuda_sparse24_check.py): the model shapes, the workloads'
sizes, building and timing an engine, comparing tokens, and the command line of a check."""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

from kvslim.engine.llm import LLM
from cuda_step_profile import decode_step_times, greedy, profile_decode, step_summary
# Llama 3.2 1B's layers; the vocabulary is SmolLM2's, whose tokenizer the engine loads.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                rope_theta=500000.0, tie_word_embeddings=True)
LLAMA_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   tie_word_embeddings=True)
FULL = dict(prompt_len=128, new_tokens=128, batch=64, check_prompts=8, kv_cache="4GiB",
            max_model_len=1024, hf_batches=(16, 32, 64), profile_steps=16)
SMOKE = dict(prompt_len=16, new_tokens=4, batch=4, check_prompts=3, kv_cache="8MiB",
             max_model_len=128, hf_batches=(2, 4), profile_steps=3)
# (attention backend, CUDA graphs, compiled step): the eager gather engine is the reference.
ENGINES = [("gather", False, False), ("gather", True, False), ("flex", False, False),
           ("flex", True, False)]
# The decoder compiled (Inductor's fused Triton kernels) inside the graphs: on the 1B model,
# whose batch-1 step is the bandwidth goal's.
COMPILED = ("gather", True, True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, fn):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def random_llama(tokenizer_dir: Path, shape: dict, device: str, root: Path,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """A Llama checkpoint of `shape` with random weights, SmolLM2's tokenizer beside."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, bos_token_id=None, eos_token_id=None, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(root)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, root / name)
    return root


def weight_bytes(llm: LLM) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied LM head is the
    embedding, counted once); an untied embedding table is only indexed, so it is left out."""
    model = llm.engine.model
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    if not model.config.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


def step_traffic(llm: LLM, plan: dict, batch: int = 1) -> int:
    """Weights plus the KV cache of `batch` sequences at the mean context while decoding."""
    runner = llm.engine.runner
    kv_per_token = runner.bytes_per_block // llm.engine.config.block_size
    context = plan["prompt_len"] + plan["new_tokens"] // 2
    return weight_bytes(llm) + batch * context * kv_per_token


def build_engine(model_dir: Path, dtype: str, device: str, backend: str, graphs: bool,
                 plan: dict, compiled: bool = False) -> LLM:
    llm = LLM(str(model_dir), dtype=dtype, device=device, kv_cache_memory=plan["kv_cache"],
              max_num_seqs=plan["batch"], max_model_len=plan["max_model_len"],
              max_num_batched_tokens=2048, enable_prefix_caching=False,
              enforce_eager=not graphs, attention_backend=backend, compile_decode=compiled)
    if graphs and not compiled and device != "cuda":
        llm.engine.runner.enable_padded_decode()      # the graphs' padded path, eagerly
    return llm


def measure_engine(llm: LLM, prompts: list[list[int]], check: list[list[int]], plan: dict,
                   device: str, profiled: bool = False, trace: Path | None = None) -> dict:
    """Tokens of the check batch (and whether each prompt alone gets the same), batch-1 decode
    rate (the median step, cuda_step_profile.py) and offline throughput; `profiled`: where a
    batch-1 step goes, `trace`: its Chrome trace there."""
    n = plan["new_tokens"]
    outs = llm.generate(check, greedy(n), use_tqdm=False)
    result = {"tokens": [o.outputs[0].token_ids for o in outs]}
    alone = [llm.generate([p], greedy(n), use_tqdm=False)[0].outputs[0].token_ids
             for p in check]
    result["batched_equals_alone"] = sum(a == b for a, b in zip(alone, result["tokens"]))
    # warm-up: every shape timed below (a compiled flex kernel meeting a new one compiles)
    llm.generate(prompts, greedy(4), use_tqdm=False)
    llm.generate(prompts[:1], greedy(4), use_tqdm=False)
    result.update(step_summary(decode_step_times(llm, prompts[0], n, device)))
    _, batch_s = timed(device, lambda: llm.generate(prompts, greedy(n), use_tqdm=False))
    result.update(step_bytes=step_traffic(llm, plan),
                  throughput_tok_s=round(len(prompts) * n / batch_s, 1))
    if profiled:
        result["profile"] = profile_decode(llm, prompts[0], plan["profile_steps"], device, trace)
    return result


def hbm(entry: dict, step_bytes: int, hbm_gbps: float, device: str) -> None:
    """GB/s a batch-1 step moves and its fraction of the peak (CUDA only)."""
    if device == "cuda" and "decode_tok_s" in entry:
        gb_s = step_bytes * entry["decode_tok_s"] / 1e9
        entry.update(gb_s=round(gb_s, 1), hbm_fraction=round(gb_s / hbm_gbps, 3))


def run_engines(model_dir: Path, dtype: str, device: str, prompts, check, plan: dict,
                hbm_gbps: float, trace_dir: Path | None = None,
                engines=tuple(ENGINES)) -> list[dict]:
    """Each of `engines` measured; the graphs engines' batch-1 steps profiled too."""
    entries, reference = [], None
    for backend, graphs, compiled in engines:
        entry, llm = {"backend": backend, "graphs": graphs, "compiled": compiled}, None
        try:
            llm, entry["startup_s"] = timed(device, lambda: build_engine(
                model_dir, dtype, device, backend, graphs, plan, compiled))
            entry["resolved_backend"] = llm.engine.runner.attention_backend
            trace = (trace_dir / f"{model_dir.name}-{backend}-graphs"
                     f"{'-compiled' if compiled else ''}.json"
                     if trace_dir is not None and graphs else None)
            entry.update(measure_engine(llm, prompts, check, plan, device, graphs, trace))
            hbm(entry, entry["step_bytes"], hbm_gbps, device)
        except Exception as e:           # one engine failing must not lose the others' numbers
            entry["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        llm = None
        release(device)
        tokens = entry.pop("tokens", None)
        if reference is None and tokens is not None:
            reference = tokens            # the eager gather engine's, when it ran
        if tokens is not None:
            entry["tokens_identical"] = tokens == reference
            entry["first_difference"] = first_difference(tokens, reference)
        entries.append(entry)
        print(f"[check] {model_dir.name} {backend} graphs={graphs} compiled={compiled}: "
              f"{ {k: v for k, v in entry.items() if k not in ('backend', 'graphs')} }",
              file=sys.stderr, flush=True)
    return entries


def first_difference(got: list[list[int]], want: list[list[int]]) -> list[int] | None:
    """(prompt, token index) of the first token that differs, or None."""
    for i, (a, b) in enumerate(zip(got, want)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return [i, j]
    return None


def count_equal_to_first(entries: list[dict], key: str) -> None:
    """Each entry's `tokens` (popped) against the first entry's: `key` = how many prompts got
    the same greedy tokens, with `prompts` beside it."""
    reference = entries[0].get("tokens") if entries else None
    for e in entries:
        tokens = e.pop("tokens", None)
        if tokens is not None and reference is not None:
            e[key] = sum(a == b for a, b in zip(tokens, reference))
            e["prompts"] = len(reference)


def check_main(check, description: str) -> int:
    """The command line of a check that returns {"engines": [...]} (cuda_quantized_check,
    cuda_sparse24_check): --smoke, --out; exit status 1 when an engine failed."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes")
    ap.add_argument("--out", type=Path, help="write the numbers here (JSON)")
    args = ap.parse_args()
    report = check(args.smoke)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 1 if any("error" in e for e in report.get("engines", [])) else 0


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
