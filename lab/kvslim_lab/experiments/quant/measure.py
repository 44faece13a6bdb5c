"""What `kvslim experiment quant` measures on one arm, each through the command that measures it
on its own (`kvslim ppl`, `bench latency`, `bench throughput`, `bench capacity`, llama.cpp's tools),
so that a number here is the number those commands print."""
from __future__ import annotations

from pathlib import Path

import torch

from kvslim_lab.experiments.quant.arms import (BYTES, CAPACITY, DECODE, HF, KV_PPL, LLAMA, PPL,
                                           THROUGHPUT, Arm)
from kvslim.models.config import ModelConfig


def measure(arm: Arm, model_dir: Path, exp) -> dict:
    """The numbers of `arm`'s measurements on `model_dir` (`exp`: the running experiment)."""
    out: dict = {}
    steps = {PPL: _ppl, KV_PPL: _kv_ppl, BYTES: _bytes, DECODE: _decode,
             THROUGHPUT: _throughput, CAPACITY: _capacity, LLAMA: _llamacpp, HF: _hf}
    for name in arm.measures:
        out.update(steps[name](arm, model_dir, exp))
    return out


def _ppl(arm, model_dir, exp) -> dict:
    from kvslim.eval.perplexity import file_perplexity
    cfg = exp.cfg
    r = file_perplexity(model_dir, cfg.test, cfg.ppl_context, cfg.ppl_stride, cfg.ppl_max_tokens,
                        show_progress=cfg.show_progress)
    return {"ppl": round(r.perplexity, 4), "ppl_tokens": r.num_tokens}


def _kv_ppl(arm, model_dir, exp) -> dict:
    """Through the engine, float cache and `arm.kv_cache_dtype` cache on the same windows: the
    delta is the cache's alone."""
    from kvslim_lab.experiments.quant.engine_ppl import engine_perplexity
    cfg = exp.cfg
    tokens = exp.test_tokens(model_dir)[:cfg.ppl_max_tokens]
    base = engine_perplexity(model_dir, tokens, cfg.ppl_context)
    quant = engine_perplexity(model_dir, tokens, cfg.ppl_context, arm.kv_cache_dtype)
    return {"ppl": round(quant.perplexity, 4), "ppl_tokens": quant.num_tokens,
            "ppl_float_kv": round(base.perplexity, 4)}


def _bytes(arm, model_dir, exp) -> dict:
    from kvslim.formats.weight_bytes import stored_weight_bytes
    wb = stored_weight_bytes(model_dir)
    dtype = "float32" if arm.kv_cache_dtype == "auto" else arm.kv_cache_dtype
    return {"weight_bytes": wb.total, "linear_bytes": wb.linear,
            "kv_bytes_per_token": ModelConfig.from_dir(model_dir).kv_cache_bytes_per_token(dtype)}


def _decode(arm, model_dir, exp) -> dict:
    from kvslim_lab.bench.latency import run_latency
    cfg = exp.cfg
    r = run_latency(model_dir, cfg.decode_input_len, cfg.decode_output_len, batches=(1,),
                    compare=[], show_progress=False, repeats=cfg.decode_repeats,
                    kv_cache_dtype=arm.kv_cache_dtype, bandwidth=exp.bandwidth())
    e = r.results[0]
    return {"decode_tokens_per_s": e.decode_tokens_per_s,
            "decode_tpot_runs_ms": [round(t * 1e3, 2) for t in e.tpot_runs_s]}


def _throughput(arm, model_dir, exp) -> dict:
    from kvslim_lab.bench.throughput import run_throughput
    cfg = exp.cfg
    r = run_throughput(model_dir, cfg.workload(), [], show_progress=cfg.show_progress,
                       kv_cache_dtype=arm.kv_cache_dtype)
    return {"throughput_tokens_per_s": r.results[0].output_tokens_per_s,
            "throughput_seconds": r.results[0].seconds}


def _capacity(arm, model_dir, exp) -> dict:
    """Peak concurrent sequences under one KV budget, model-dtype cache vs `arm`'s."""
    from kvslim_lab.bench.capacity import run_capacity
    cfg = exp.cfg
    runs = {dtype: run_capacity([model_dir], cfg.capacity_kv_memory, cfg.capacity_context,
                                show_progress=False, kv_cache_dtype=dtype).entries[0]
            for dtype in ("auto", arm.kv_cache_dtype)}
    base, quant = runs["auto"], runs[arm.kv_cache_dtype]
    return {"capacity_peak_float_kv": base.peak_running, "capacity_peak": quant.peak_running,
            "capacity_fit_float_kv": base.max_sequences, "capacity_fit": quant.max_sequences,
            "capacity_ratio": round(quant.peak_running / max(1, base.peak_running), 2)}


def _llamacpp(arm, gguf: Path, exp) -> dict:
    """llama.cpp on its own file: batch-1 decode (llama-bench), parallel decoding at each -npl
    (llama-batched-bench; the best is its offline throughput), perplexity on kvslim's windows
    when they can be reproduced (stride = context - 1), and the file's weight bytes."""
    from kvslim.formats.weight_bytes import gguf_weight_bytes
    cfg, tools = exp.cfg, exp.tools
    w = cfg.workload()
    wb = gguf_weight_bytes(gguf)
    sweep = tools.parallel_decode(gguf, w.input_len, w.output_len, cfg.llamacpp_parallel)
    best = max(sweep, key=sweep.get)
    out = {"weight_bytes": wb.total, "linear_bytes": wb.linear, "file": gguf.name,
           "decode_tokens_per_s": round(tools.decode_tokens_per_s(
               gguf, cfg.decode_input_len, cfg.decode_output_len, cfg.decode_repeats), 1),
           "throughput_tokens_per_s": sweep[best], "throughput_parallel": best,
           "throughput_sweep": {str(k): v for k, v in sweep.items()}}
    out.update(exp.llamacpp_ppl(gguf))
    return out


def _hf(arm, model_dir, exp) -> dict:
    """HF transformers' offline throughput at each batch size of the sweep; the best counts."""
    import time
    from kvslim_lab.bench.peer_hf import HFPeer
    from kvslim_lab.bench.workload import special_ids
    from kvslim.tokenizer.tokenizer import Tokenizer
    cfg = exp.cfg
    w = cfg.workload()
    peer = HFPeer(model_dir, torch.float32)
    prompts = w.prompts(ModelConfig.from_dir(model_dir).vocab_size,
                        special_ids(Tokenizer.from_dir(model_dir)))
    peer.generate(prompts[:1], 2, 1)                                    # warm-up
    sweep = {}
    for b in cfg.hf_batch_sizes:
        start = time.perf_counter()
        peer.generate(prompts, w.output_len, b)
        sweep[b] = round(w.num_prompts * w.output_len / (time.perf_counter() - start), 1)
    best = max(sweep, key=sweep.get)
    return {"throughput_tokens_per_s": sweep[best], "throughput_batch": best,
            "throughput_sweep": {str(k): v for k, v in sweep.items()}}
