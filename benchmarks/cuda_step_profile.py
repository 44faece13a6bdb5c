"""Where a batch-1 decode step goes: the engine's step timed one by one, and profiled.

Part of the prepared GPU check (benchmarks/cuda_decode_check.py), written to tell in one run
what keeps a 1B model's batch-1 decode from the memory roofline:

- `decode_step_times`: the engine stepped by hand over one request, each step's wall time after
  the prefill (the sampled token's copy to the host ends every step, so a step is whole when
  `step()` returns). The median gives the decode rate: a compilation or a stray hiccup in one
  step no longer decides the figure (the first GPU run lost two rates to one).
- `profile_decode`: torch.profiler over a few such steps. The engine's phases are marked with
  `record_function` from here, by wrapping the bound methods of this one engine, so the product
  carries no profiling code: schedule, prepare (inputs and tables), graph (static buffers and
  the replay, or the eager decoder), logits (the LM head), sample, postprocess (the scheduler's
  bookkeeping) and the rest of `step()` (outputs, detokenization). From the trace: host
  milliseconds per phase and step; on CUDA, device-busy milliseconds per step (the kernels'
  own time), the idle gap that leaves, kernel launches and graph launches per step, host time
  in synchronising calls, and the costliest kernels. Optionally the Chrome trace itself.

On a CPU (`--smoke`) the same code runs with CPU activities only, which is how it is tested."""
from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from kvslim.engine.sampling_params import SamplingParams

PHASES = ("schedule", "prepare", "graph", "logits", "sample", "postprocess")
# CUDA runtime calls that make the host wait for the device, and launches.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpyAsync", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_CALLS = ("cudaGraphLaunch",)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_step_times(llm, prompt: list[int], n: int, device: str) -> list[float]:
    """Seconds of each decode step of one greedy request of `n` new tokens (n - 1 steps: the
    first token comes with the prefill, which is not timed)."""
    engine = llm.engine
    engine.add_request(prompt, greedy(n))
    engine.step()                                   # the prefill, and the first token
    times = []
    while engine.has_unfinished_requests():
        _sync(device)
        start = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def step_summary(times: list[float]) -> dict:
    """Median and spread of step times, and the rate the median gives."""
    ms = sorted(t * 1e3 for t in times)
    median = statistics.median(ms)
    return {"decode_tok_s": round(1e3 / median, 1), "step_ms_median": round(median, 3),
            "step_ms_p10": round(ms[len(ms) // 10], 3),
            "step_ms_p90": round(ms[-1 - len(ms) // 10], 3),
            "steps_timed": len(ms)}


@contextlib.contextmanager
def phases_marked(llm):
    """The engine's phases under `record_function` labels, for as long as the block runs."""
    engine, runner = llm.engine, llm.engine.runner
    targets = [("schedule", engine.scheduler, "schedule"), ("prepare", runner, "_prepare"),
               ("logits", runner.model, "compute_logits"),
               ("postprocess", engine.scheduler, "postprocess")]
    if runner.decode_graphs is not None:
        targets.append(("graph", runner.decode_graphs, "run"))
    wrapped = []
    for label, owner, name in targets:
        original = getattr(owner, name)
        setattr(owner, name, _marked(f"kvslim/{label}", original))
        wrapped.append((owner, name))
    sampler = runner.sampler
    runner.sampler = _MarkedSampler(sampler)
    try:
        yield
    finally:
        runner.sampler = sampler
        for owner, name in wrapped:
            delattr(owner, name)                    # the class's method again


def _marked(label: str, fn):
    def call(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return call


class _MarkedSampler:
    """The runner's sampler, its calls marked (a call goes through the type: wrapping the
    bound `__call__` would not be seen)."""
    def __init__(self, sampler):
        self._sampler = sampler

    def __call__(self, *args, **kwargs):
        with record_function("kvslim/sample"):
            return self._sampler(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def profile_decode(llm, prompt: list[int], steps: int, device: str,
                   trace: Path | None = None) -> dict:
    """Profile `steps` batch-1 decode steps of one request (after its prefill)."""
    engine = llm.engine
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    engine.add_request(prompt, greedy(steps + 1))
    engine.step()
    _sync(device)
    with phases_marked(llm), profile(activities=activities) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            with record_function("kvslim/step"):
                engine.step()
        _sync(device)
        wall = time.perf_counter() - start
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return summarize(prof, steps, wall, device)


def summarize(prof, steps: int, wall_s: float, device: str) -> dict:
    """Per decode step: wall ms, host ms of each phase, and on CUDA the device's side."""
    events = prof.key_averages()
    host = {e.key: e.cpu_time_total / 1e3 / steps for e in events}
    step_ms = host.get("kvslim/step", wall_s * 1e3 / steps)
    phases = {p: round(host.get(f"kvslim/{p}", 0.0), 3) for p in PHASES}
    summary = {"steps": steps, "wall_ms_per_step": round(wall_s * 1e3 / steps, 3),
               "host_ms_per_step": phases,          # disjoint: none runs inside another
               "host_ms_outside_phases": round(step_ms - sum(phases.values()), 3)}
    if device == "cuda":
        summary.update(device_side(events, steps, step_ms))
    else:
        summary["note"] = "no CUDA: host side only"
    return summary


def device_side(events, steps: int, step_ms: float) -> dict:
    """Kernels' own time per step, the idle gap it leaves, launches, syncs, costliest kernels."""
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    count = {e.key: e.count for e in events}
    host_ms = {e.key: e.cpu_time_total / 1e3 / steps for e in events}
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:10]
    return {
        "device_busy_ms_per_step": round(busy, 3),
        "device_idle_fraction": round(max(0.0, 1 - busy / step_ms), 3) if step_ms else None,
        "kernel_launches_per_step": round(sum(count.get(k, 0) for k in LAUNCH_CALLS) / steps, 1),
        "graph_launches_per_step": round(sum(count.get(k, 0) for k in GRAPH_CALLS) / steps, 1),
        "sync_calls_per_step": {k: round(count[k] / steps, 1) for k in SYNC_CALLS if k in count},
        "sync_host_ms_per_step": round(sum(host_ms.get(k, 0.0) for k in SYNC_CALLS), 3),
        "top_kernels": [{"name": e.key[:120], "ms_per_step": round(
            e.self_device_time_total / 1e3 / steps, 4), "calls_per_step": round(
            e.count / steps, 1)} for e in top],
    }
