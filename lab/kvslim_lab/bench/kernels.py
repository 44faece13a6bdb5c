"""`kvslim bench kernels`: each linear kernel (float32, INT8 weight-only, 4-bit group-wise, W8A8)
timed on SmolLM2-135M's linear shapes for each row count M.

Per call it reports µs, the effective GB/s of weight bytes read (the stored form: 4 B/weight
for float32, 1 for INT8, 1/2 plus group scales and zeros for 4-bit) and GOP/s (2*M*in*out).
Candidates take turns within each round, and a cell is the median of the rounds, so a neighbour
that loads the shared cores for a while slows every candidate alike rather than one of them.
Before timing, every candidate's output is checked against its reference (see
kernel_candidates); one that disagrees is reported as wrong and not timed."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from kvslim_lab.bench.kernel_candidates import Candidate, build_candidates
from kvslim_lab.bench.kernel_choice import KernelChoice, choose, format_choices
from kvslim_lab.bench.machine import machine_info

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, vocabulary 49152.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
GROUPS = (32, 64, 128)


@dataclass
class KernelTiming:
    shape: str
    in_features: int
    out_features: int
    candidate: str
    family: str
    rows: int
    us: float | None              # median µs per call; None when the output was wrong
    gb_s: float | None
    gop_s: float | None
    max_rel_err: float
    runs_us: list[float] = field(default_factory=list)


@dataclass
class KernelsResult:
    machine: dict
    rounds: int
    timings: list[KernelTiming]
    compile_s: dict[str, float]          # compiled candidate @ shape -> first-call seconds
    torchao: str                         # version, or why it was not measured
    skipped: dict[str, str]              # candidate -> why it could not be built
    choices: list[KernelChoice] = field(default_factory=list)   # per shape and M (kernel_choice)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_shapes(text: str | None) -> dict[str, tuple[int, int]]:
    """'qkv,lm_head' picks named shapes; 'name=IN:OUT' adds any other."""
    if not text:
        return dict(SHAPES)
    shapes = {}
    for item in text.split(","):
        if "=" in item:
            name, dims = item.split("=", 1)
            in_f, out_f = (int(d) for d in dims.split(":"))
            shapes[name] = (in_f, out_f)
        else:
            shapes[item] = SHAPES[item]
    return shapes


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


def _time(c: Candidate, x: torch.Tensor, target_s: float) -> float:
    """Seconds per call: calls repeated until `target_s` has passed (at least 2)."""
    n, start = 0, time.perf_counter()
    while True:
        c(x)
        n += 1
        elapsed = time.perf_counter() - start
        if n >= 2 and elapsed >= target_s:
            return elapsed / n


def _measure_shape(name, in_f, out_f, cands, batches, rounds, target_s) -> list[KernelTiming]:
    torch.manual_seed(0)
    rows_out = []
    for m in batches:
        x = torch.randn(m, in_f)
        ok = []
        for c in cands:
            err = max_rel_err(c(x), c.reference(x))
            ok.append((c, err))
        runs = {c.name: [] for c, _ in ok}
        for _ in range(rounds):
            for c, err in ok:
                if err <= c.rtol:
                    runs[c.name].append(_time(c, x, target_s) * 1e6)
        for c, err in ok:
            us = statistics.median(runs[c.name]) if runs[c.name] else None
            rows_out.append(KernelTiming(
                name, in_f, out_f, c.name, c.family, m, us,
                None if us is None else c.weight_bytes / us / 1e3,
                None if us is None else 2 * m * in_f * out_f / us / 1e3, err, runs[c.name]))
    return rows_out


def torchao_status(requested: bool) -> str:
    if not requested:
        return "not requested"
    try:
        import torchao
    except Exception as e:                                           # noqa: BLE001
        return f"unavailable: {type(e).__name__}: {e}"[:200]
    return f"torchao {torchao.__version__}"


def run_kernels(shapes: dict[str, tuple[int, int]] | None = None, batches=BATCHES,
                groups=GROUPS, rounds: int = 5, target_ms: float = 20.0, compile_: bool = True,
                torchao: bool = True) -> KernelsResult:
    shapes = shapes or dict(SHAPES)
    timings, compile_s, skipped = [], {}, {}
    status = torchao_status(torchao)
    with torch.inference_mode():
        for name, (in_f, out_f) in shapes.items():
            w = torch.randn(out_f, in_f) / in_f ** 0.5
            cands = build_candidates(w, tuple(groups), compile_, status.startswith("torchao"),
                                     skipped)
            timings += _measure_shape(name, in_f, out_f, cands, batches, rounds,
                                      target_ms / 1e3)
            compile_s.update({f"{c.name}@{name}": round(c.compile_s, 2) for c in cands
                              if c.compile_s is not None})
    return KernelsResult(machine_info().to_dict(), rounds, timings, compile_s, status, skipped,
                         choose(timings))


def format_kernels(r: KernelsResult) -> str:
    m = r.machine
    lines = [f"kernels on {m['cpu']} ({m['torch_threads']} threads, torch {m['torch']}); "
             f"median of {r.rounds} interleaved rounds; {r.torchao}",
             "each cell: µs per call, GB/s of weight bytes read, GOP/s"]
    batches = sorted({t.rows for t in r.timings})
    for shape in dict.fromkeys(t.shape for t in r.timings):
        ts = [t for t in r.timings if t.shape == shape]
        lines += ["", f"{shape} {ts[0].in_features}->{ts[0].out_features}",
                  f"{'candidate':34}" + "".join(f"{'M=' + str(b):>22}" for b in batches)]
        for name in dict.fromkeys(t.candidate for t in ts):
            cells = {t.rows: t for t in ts if t.candidate == name}
            lines.append(f"{name:34}" + "".join(_cell(cells.get(b)) for b in batches))
    if r.compile_s:
        lines += ["", "compile (first call) seconds: " +
                  ", ".join(f"{k} {v}" for k, v in r.compile_s.items())]
    lines += [f"not measured: {k}: {v}" for k, v in r.skipped.items()]
    return "\n".join(lines + format_choices(r.choices))


def _cell(t: KernelTiming | None) -> str:
    if t is None:
        return f"{'-':>22}"
    if t.us is None:
        return f"{'WRONG ' + format(t.max_rel_err, '.0e'):>22}"
    return f"{t.us:>10.1f}{t.gb_s:>6.1f}{t.gop_s:>6.0f}"
