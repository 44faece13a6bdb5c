"""`kvslim bench throughput`: offline throughput of kvslim and, in the same run, on the same
model, prompts, precision (float32) and threads, of HF transformers (static padded batches) and
llama.cpp (request by request)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from kvslim_lab.bench.runners import kvslim_llm, peers
from kvslim_lab.bench.workload import Workload, special_ids
from kvslim.engine.config import EngineConfig
from kvslim.engine.sampling_params import SamplingParams


@dataclass
class EngineThroughput:
    engine: str
    label: str
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


@dataclass
class ThroughputResult:
    model: str
    workload: dict
    threads: int
    dtype: str
    hf_batch_size: int
    results: list[EngineThroughput] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def ratio(self, other: str) -> float | None:
        by = {r.engine: r for r in self.results}
        if "kvslim" in by and other in by:
            return by["kvslim"].output_tokens_per_s / by[other].output_tokens_per_s
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratios"] = {f"kvslim/{r.engine}": round(self.ratio(r.engine), 2)
                       for r in self.results if r.engine != "kvslim"}
        return d


def _entry(engine, label, seconds, w: Workload) -> EngineThroughput:
    n = w.num_prompts
    return EngineThroughput(engine, label, round(seconds, 2), round(n / seconds, 3),
                            round(n * w.output_len / seconds, 1),
                            round(n * (w.input_len + w.output_len) / seconds, 1))


def run_throughput(model_dir, w: Workload, compare: list[str], hf_batch_size: int = 8,
                   kv_cache_memory: str = "2GiB", show_progress: bool = True,
                   kv_cache_dtype: str = "auto", speculative: dict | None = None,
                   parallel: dict | None = None, linear_activations: str | None = None
                   ) -> ThroughputResult:
    """`parallel`: kvslim's tensor-parallel options; its ranks share the threads."""
    result = ThroughputResult(str(model_dir), asdict(w), torch.get_num_threads(), "float32",
                              hf_batch_size)
    parallel = parallel or {}
    llm = kvslim_llm(model_dir, kv_cache_memory, max_num_seqs=max(64, w.num_prompts),
                     kv_cache_dtype=kv_cache_dtype, speculative=speculative,
                     linear_activations=linear_activations, **parallel)
    prompts = w.prompts(llm.engine.model_config.vocab_size, special_ids(llm.tokenizer))
    params = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=show_progress)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == w.output_len for o in outs)
    ranks = parallel.get("tensor_parallel_size", 1)
    label = "kvslim (continuous batching)" if ranks == 1 else \
        f"kvslim (continuous batching, {ranks} tensor-parallel ranks)"
    if linear_activations not in (None, EngineConfig.linear_activations):
        label += f", {linear_activations} activations"
    result.results.append(_entry("kvslim", label, seconds, w))
    llm.shutdown()                           # its ranks give the cores back to the peers
    del llm
    for name, runner in peers(compare, model_dir, result.skipped, show_progress):
        if name == "hf":
            runner.generate(prompts[:1], 2, 1)                       # warm-up
            seconds = runner.generate(prompts, w.output_len, hf_batch_size)
            label = f"{runner.label}, batches of {hf_batch_size}"
        else:
            runner.run(prompts[0], 2)
            seconds = runner.generate(prompts, w.output_len)
            label = f"{runner.label}, one request at a time"
        result.results.append(_entry(name, label, seconds, w))
    return result


def format_throughput(r: ThroughputResult) -> str:
    w = r.workload
    lines = [f"offline throughput: {w['num_prompts']} prompts x {w['input_len']} in / "
             f"{w['output_len']} out, {r.dtype}, {r.threads} threads, model {r.model}",
             f"{'engine':<58} {'seconds':>8} {'req/s':>7} {'out tok/s':>10} {'total tok/s':>12}"]
    for e in r.results:
        lines.append(f"{e.label:<58} {e.seconds:>8.1f} {e.requests_per_s:>7.2f} "
                     f"{e.output_tokens_per_s:>10.1f} {e.total_tokens_per_s:>12.1f}")
    for e in r.results:
        if e.engine != "kvslim":
            lines.append(f"kvslim / {e.engine}: {r.ratio(e.engine):.2f}x output tokens/s")
    lines += [f"skipped {s}" for s in r.skipped]
    return "\n".join(lines)
