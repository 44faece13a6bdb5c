"""`kvslim bench profile`: where a decode step's time goes — matrix products, attention (the
KV-cache writes and reads included), the other tensor operations, and what is left of the step
outside any operation (Python, the framework's dispatch, the scheduler, sampling bookkeeping).

Measured with torch's profiler over pure decode steps of a running batch. The profiler costs a
little per operation, so the step it sees is slower than the unprofiled step, which is reported
beside it; the shares are what to read."""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from kvslim_lab.bench.runners import kvslim_llm
from kvslim_lab.bench.workload import Workload, special_ids
from kvslim.engine.sampling_params import SamplingParams

# The matrix products: torch's, its weight-only and integer ones, and kvslim's own kernels.
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "mkldnn::_linear_pointwise",
            "kvslim::onednn_linear", "aten::_weight_int4pack_mm_for_cpu",
            "aten::_weight_int8pack_mm", "aten::_int_mm", "kvslim::group_mm",
            "kvslim::tiled_mm", "kvslim::group_mm_q8"}
ATTENTION_PREFIXES = ("aten::_scaled_dot_product", "aten::scaled_dot_product",
                      "kvslim::paged_decode")
CACHE_OPS = {"aten::index_select", "aten::_index_put_impl_", "kvslim::store_slots",
             "kvslim::write_slots"}
CATEGORIES = ("gemm", "attention", "other_ops", "outside_ops")


@dataclass
class DecodeProfile:
    batch: int
    steps: int
    step_ms: float                        # unprofiled
    profiled_step_ms: float
    ms_per_step: dict[str, float]          # category -> ms per profiled step
    top_ops: list[tuple[str, float]]       # the costliest operations, ms per step
    op_calls: float = 0.0                  # operator calls per step (nested ones included)


@dataclass
class ProfileResult:
    model: str
    input_len: int
    threads: int
    compiled: bool = False
    profiles: list[DecodeProfile] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def categorise(events: Iterable) -> dict[str, float]:
    """Self CPU microseconds of profiler key averages, summed per category."""
    totals = dict.fromkeys(CATEGORIES[:-1], 0.0)
    for e in events:
        name = e.key
        if name in GEMM_OPS:
            cat = "gemm"
        elif name.startswith(ATTENTION_PREFIXES) or name in CACHE_OPS:
            cat = "attention"
        else:
            cat = "other_ops"
        totals[cat] += e.self_cpu_time_total
    return totals


def _start_batch(llm, prompts, steps: int) -> None:
    """Requests that decode for at least `steps` more steps, with their prefills done."""
    params = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < len(s.prompt_token_ids)
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):                                   # warm-up decode steps
        engine.step()


def _timed_steps(engine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def profile_decode(model_dir, batches: tuple[int, ...] = (1, 8), input_len: int = 128,
                   steps: int = 16, compile_decode: bool = False) -> ProfileResult:
    """compile_decode: profile the compiled CPU decode step (its fused loops count as
    other_ops: the program's own profiler event holds them)."""
    llm = kvslim_llm(model_dir, "1GiB", max_num_seqs=max(batches), compile_decode=compile_decode)
    return profile_llm(llm, str(model_dir), batches, input_len, steps, compile_decode)


def profile_llm(llm, model: str, batches: tuple[int, ...], input_len: int, steps: int,
                compiled: bool) -> ProfileResult:
    """The profile of an engine already built (with no request of its own running)."""
    result = ProfileResult(model, input_len, torch.get_num_threads(), compiled)
    prompts = Workload(max(batches), input_len, 1, seed=2).prompts(
        llm.engine.model_config.vocab_size, special_ids(llm.tokenizer))
    for b in batches:
        _start_batch(llm, prompts[:b], steps)
        step_s = _timed_steps(llm.engine, steps)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            profiled_s = _timed_steps(llm.engine, steps)
        events = prof.key_averages()
        per_step = {k: v / 1e3 / steps for k, v in categorise(events).items()}
        per_step["outside_ops"] = max(0.0, profiled_s * 1e3 - sum(per_step.values()))
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
        result.profiles.append(DecodeProfile(
            b, steps, round(step_s * 1e3, 2), round(profiled_s * 1e3, 2),
            {k: round(v, 2) for k, v in per_step.items()},
            [(e.key, round(e.self_cpu_time_total / 1e3 / steps, 2)) for e in top],
            round(sum(e.count for e in events) / steps, 1)))
        for req_id in list(llm.engine.requests):
            llm.engine.abort_request(req_id)
    return result


def format_profile(r: ProfileResult) -> str:
    lines = [f"decode step profile{' (compiled)' if r.compiled else ''}: {r.input_len}-token "
             f"prompts, {r.threads} threads, model {r.model}",
             f"{'batch':>5} {'step ms':>8} {'profiled':>9} " +
             " ".join(f"{c:>12}" for c in CATEGORIES)]
    for p in r.profiles:
        cells = " ".join(f"{p.ms_per_step[c]:>6.1f} ({p.ms_per_step[c] / p.profiled_step_ms:>3.0%})"
                         for c in CATEGORIES)
        lines.append(f"{p.batch:>5} {p.step_ms:>8.1f} {p.profiled_step_ms:>9.1f} {cells}")
    for p in r.profiles:
        lines.append(f"batch {p.batch} costliest ops (ms/step): " +
                     ", ".join(f"{name} {ms}" for name, ms in p.top_ops))
    return "\n".join(lines)
