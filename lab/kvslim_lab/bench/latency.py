"""`kvslim bench latency`: decode speed at batch 1 and batch 8 — time to first token, time per
output token, decode tokens/s — for kvslim and its peers in the same run, with the roofline: the
machine's measured memory bandwidth and the fraction of it each engine's decode step achieves
(weights + KV-cache bytes read per step / step time).

With tensor parallelism (`parallel`, `--tensor-parallel-size N`) kvslim's ranks read their
shards at the same time, so a step's bytes are those of all the ranks together: the whole
checkpoint once, and every rank's KV cache (a replicated KV head is read by each rank holding
it: `kv_bytes_per_token` is N times one rank's)."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvslim_lab.bench.machine import Bandwidth, memory_bandwidth
from kvslim_lab.bench.runners import kvslim_llm, peers
from kvslim_lab.bench.workload import Workload, special_ids
from kvslim.engine.config import EngineConfig
from kvslim.engine.sampling_params import SamplingParams
from kvslim.formats.info import weight_bytes as stored_weight_bytes


@dataclass
class EngineLatency:
    engine: str
    label: str
    batch: int
    ttft_s: float
    tpot_s: float
    decode_tokens_per_s: float
    bytes_per_step: int
    achieved_gb_s: float
    fraction_of_bandwidth: float
    tpot_runs_s: list[float] = field(default_factory=list)   # every repeat; tpot_s is the median


@dataclass
class LatencyResult:
    model: str
    input_len: int
    output_len: int
    threads: int
    bandwidth: Bandwidth
    weight_bytes: int
    kv_bytes_per_token: int                  # all tensor-parallel ranks together
    results: list[EngineLatency] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    repeats: int = 1
    tensor_parallel_size: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    def ratio(self, other: str, batch: int) -> float | None:
        by = {(r.engine, r.batch): r for r in self.results}
        a, b = by.get(("kvslim", batch)), by.get((other, batch))
        return a.decode_tokens_per_s / b.decode_tokens_per_s if a and b else None


def _entry(result: LatencyResult, engine, label, batch, runs: list[tuple[float, float]]
           ) -> EngineLatency:
    ttft = statistics.median(r[0] for r in runs)
    tpot = statistics.median(r[1] for r in runs)
    context = result.input_len + result.output_len // 2          # mean context while decoding
    step_bytes = result.weight_bytes + batch * context * result.kv_bytes_per_token
    gb_s = step_bytes / tpot / 1e9
    return EngineLatency(engine, label, batch, round(ttft, 4), round(tpot, 5),
                         round(batch / tpot, 1), step_bytes, round(gb_s, 2),
                         round(gb_s / result.bandwidth.read_gb_s, 3),
                         [round(r[1], 5) for r in runs])


def run_latency(model_dir, input_len: int = 128, output_len: int = 64,
                batches: tuple[int, ...] = (1, 8), compare: list[str] = (),
                show_progress: bool = True, repeats: int = 3,
                kv_cache_dtype: str = "auto", bandwidth: Bandwidth | None = None,
                speculative: dict | None = None, parallel: dict | None = None,
                linear_activations: str | None = None) -> LatencyResult:
    """Each engine and batch measured `repeats` times, the engines taking turns within every
    round, so that a slow spell of a shared machine does not fall on one engine only; the
    tables show medians. `bandwidth`: the machine's, measured once by a caller that runs this
    many times (default: measured here). `parallel`: kvslim's tensor-parallel options."""
    parallel = parallel or {}
    ranks = parallel.get("tensor_parallel_size", 1)
    llm = kvslim_llm(model_dir, "1GiB", max_num_seqs=max(batches), kv_cache_dtype=kv_cache_dtype,
                     speculative=speculative, linear_activations=linear_activations,
                     **parallel)
    try:
        return _measure_all(llm, model_dir, input_len, output_len, batches, compare,
                            show_progress, repeats, bandwidth, ranks)
    finally:
        llm.shutdown()                       # the tensor-parallel ranks, if any


def _measure_all(llm, model_dir, input_len, output_len, batches, compare, show_progress,
                 repeats, bandwidth, ranks: int) -> LatencyResult:
    # Counted from the checkpoint: the engine's runtime layout (packed weights) is not the
    # model's size. Every weight is read once per decode step (by the rank holding it).
    weight_bytes = stored_weight_bytes(model_dir, llm.engine.model_config,
                                       llm.engine.runner.dtype.itemsize)
    per_rank_kv = llm.engine.runner.bytes_per_block // llm.engine.config.block_size
    result = LatencyResult(str(model_dir), input_len, output_len, torch.get_num_threads(),
                           bandwidth or memory_bandwidth(), weight_bytes, ranks * per_rank_kv,
                           repeats=repeats, tensor_parallel_size=ranks)
    w = Workload(max(batches), input_len, output_len, seed=1)
    prompts = w.prompts(llm.engine.model_config.vocab_size, special_ids(llm.tokenizer))
    label = "kvslim" if ranks == 1 else f"kvslim ({ranks} tensor-parallel ranks)"
    if llm.engine.config.linear_activations != EngineConfig.linear_activations:
        label += f", {llm.engine.config.linear_activations} activations"
    engines = [("kvslim", label, kvslim_measure(llm, prompts, output_len))]
    for name, runner in peers(compare, model_dir, result.skipped, show_progress):
        engines.append((name, runner.label, _peer_measure(name, runner, prompts, output_len)))
    if "llamacpp" in compare:
        result.skipped += [f"llamacpp batch {b}: its Python API decodes one sequence at a time"
                           for b in batches if b > 1]
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in tqdm(range(repeats), desc="latency rounds", disable=not show_progress):
        for name, _, measure in engines:
            for b in batches:
                if not (name == "llamacpp" and b > 1):
                    runs.setdefault((name, b), []).append(measure(b))
    labels = {name: label for name, label, _ in engines}
    result.results = [_entry(result, name, labels[name], b, r) for (name, b), r in runs.items()]
    return result


def models_decode_speed(model_dirs: dict[str, Path], input_len: int, output_len: int,
                        repeats: int, batch: int = 1,
                        options: dict[str, dict] | None = None) -> dict[str, float]:
    """Decode tokens/s of several models (name -> directory) at `batch` sequences (all of them
    together) in one run, taking turns in every round, so that their ratios are not one slow
    spell of a shared machine: from the median time per output token of `repeats` rounds. The
    models are held at once; `options`: engine options of some of them (name -> options)."""
    options = options or {}
    llms = {name: kvslim_llm(d, "256MiB", max_num_seqs=batch, **options.get(name, {}))
            for name, d in model_dirs.items()}
    try:
        measures = {}
        for name, llm in llms.items():
            w = Workload(batch, input_len, output_len, seed=1)
            prompts = w.prompts(llm.engine.model_config.vocab_size, special_ids(llm.tokenizer))
            measures[name] = kvslim_measure(llm, prompts, output_len)
        tpots: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(repeats):
            for name, measure in measures.items():
                tpots[name].append(measure(batch)[1])
        return {name: round(batch / statistics.median(t), 1) for name, t in tpots.items()}
    finally:
        for llm in llms.values():
            llm.shutdown()


def kvslim_measure(llm, prompts, output_len: int):
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    def measure(b: int) -> tuple[float, float]:
        outs = llm.generate(prompts[:b], params, use_tqdm=False)
        return (sum(o.metrics.time_to_first_token for o in outs) / b,
                sum(o.metrics.time_per_output_token for o in outs) / b)
    return measure


def _peer_measure(name: str, runner, prompts, output_len: int):
    def measure(b: int) -> tuple[float, float]:
        if name == "hf":
            runner.generate(prompts[:b], 2, b)                      # warm-up
            return runner.latency(prompts[:b], output_len)
        runner.run(prompts[0], 2)
        return runner.latency(prompts[0], output_len)
    return measure


def format_latency(r: LatencyResult) -> str:
    lines = [f"decode latency: {r.input_len} prompt tokens, {r.output_len} generated, float32, "
             f"{r.threads} threads, median of {r.repeats} runs, model {r.model}",
             f"memory bandwidth: {r.bandwidth.read_gb_s} GB/s read, {r.bandwidth.copy_gb_s} "
             f"GB/s copy; weights {r.weight_bytes / 1e6:.0f} MB, KV {r.kv_bytes_per_token} B/token",
             f"{'engine':<44} {'batch':>5} {'TTFT s':>8} {'TPOT ms':>8} {'tok/s':>7} "
             f"{'GB/s':>6} {'of BW':>6}"]
    for e in r.results:
        lines.append(f"{e.label:<44} {e.batch:>5} {e.ttft_s:>8.3f} {e.tpot_s * 1e3:>8.1f} "
                     f"{e.decode_tokens_per_s:>7.1f} {e.achieved_gb_s:>6.1f} "
                     f"{e.fraction_of_bandwidth:>6.0%}")
    for e in r.results:
        if e.engine != "kvslim" and r.ratio(e.engine, e.batch):
            lines.append(f"kvslim / {e.engine} at batch {e.batch}: "
                         f"{r.ratio(e.engine, e.batch):.2f}x decode tokens/s")
    lines += [f"skipped {s}" for s in r.skipped]
    return "\n".join(lines)
