"""Does a 2:4 sparse weight kernel pay on this CPU? kvslim's `sparse24_mm` (kernels/sparse24.py:
the kept float32 values and their 2-bit positions, 136 bytes per 16 columns x 4 inputs against
256 dense) beside the dense kernels of a float and a quantized model: kvslim's `tiled_mm`
(float32, the engine's), torch's F.linear in float32 and in bfloat16, and kvslim's 4-bit
`group_mm` (groups of 32, with offsets), on SmolLM2-135M's linear shapes and two larger ones,
all computing with the same 2:4-pruned weight.

Weights are read from memory (`memory`: each candidate cycles through copies of its weight
adding up to `--stream-mb`, more than the L3, as a decode step reads each layer once) and from
cache (`cache`: one copy, called again and again). Candidates take turns within each round; a
cell is the median of the rounds' µs per call. GB/s counts the bytes a call reads for its
weight.

    python benchmarks/sparse_kernel.py [--batches 1,4,16] [--rounds 7] [--where memory,cache]
        [--threads 1,2] [--stream-mb 128] [--json docs/pruning_kernel.json]

Each thread count is its own pass over the shapes (one thread is the steadier number on a
machine whose other core is busy: two threads wait for each other)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvslim_lab.bench.machine import machine_info, memory_bandwidth
from kvslim.kernels import sparse24, tiled_gemm

# (out, in): SmolLM2-135M's projections (per layer: q, k, v, o, gate, up, down) and LM head,
# then a 1B-class attention and MLP shape.
SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536),
          "lm_head": (49152, 576), "2048x2048": (2048, 2048), "8192x2048": (8192, 2048)}
PER_STEP = {"q/o": 60, "k/v": 60, "gate/up": 60, "down": 30, "lm_head": 1}   # 30 layers
KERNELS = ("tiled_mm f32", "F.linear f32", "F.linear bf16", "group_mm 4-bit", "sparse24 f32")
SAME_PRECISION = {"sparse24 f32": "tiled_mm f32"}
GROUP = 32


def pruned_weight(out: int, k: int, seed: int) -> torch.Tensor:
    """A random weight pruned to 2:4 by magnitude (the two largest of every four inputs)."""
    w = torch.randn(out, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    keep = w.view(out, k // 4, 4).abs().topk(2, dim=-1).indices
    mask = torch.zeros(out, k // 4, 4).scatter(-1, keep, 1.0).view(out, k)
    return w * mask


def quantize4(w: torch.Tensor):
    """4-bit asymmetric per group of 32 inputs: w ~ q * s + m, q in 0..15."""
    g = w.view(w.shape[0], -1, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view_as(w), s, lo


def makers(w: torch.Tensor) -> dict:
    """kernel -> (packed weight, call(x, packed), bytes a call reads)."""
    q, s, m = quantize4(w)
    group = tiled_gemm.pack_group_weight(q, s, m, 4)
    sparse = sparse24.pack_sparse24_weight(w)
    tiled = tiled_gemm.pack_float_weight(w)
    bf16 = w.bfloat16()
    return {
        "tiled_mm f32": (tiled, tiled_gemm.float_linear, tiled.tiles.nbytes),
        "F.linear f32": (w.clone(), lambda x, wt: F.linear(x, wt), w.nbytes),
        "F.linear bf16": (bf16, lambda x, wt: F.linear(x.bfloat16(), wt), bf16.nbytes),
        "group_mm 4-bit": (group, tiled_gemm.group_linear, group.nbytes()),
        "sparse24 f32": (sparse, sparse24.sparse24_linear, sparse.nbytes())}


def copies_of(packed, n: int) -> list:
    """n copies of a packed weight at distinct addresses (tensors cloned, fields kept)."""
    if isinstance(packed, torch.Tensor):
        return [packed] + [packed.clone() for _ in range(n - 1)]
    fields = vars(packed)
    return [packed] + [type(packed)(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                       for k, v in fields.items()}) for _ in range(n - 1)]


def check(w: torch.Tensor, built: dict) -> None:
    """Every float kernel computes the pruned weight's product; the 2:4 one matches tiled_mm."""
    x = torch.randn(3, w.shape[1])
    ref = x.double() @ w.double().T
    for name in ("tiled_mm f32", "F.linear f32", "sparse24 f32"):
        packed, call, _ = built[name]
        err = float((call(x, packed).double() - ref).abs().max() / ref.abs().max())
        if err > 1e-5:
            raise SystemExit(f"{name} is wrong on {tuple(w.shape)}: relative error {err:.1e}")


def time_pass(call, weights: list, x: torch.Tensor, target_s: float) -> float:
    """µs per call, cycling through `weights` until `target_s` has passed (one pass at least)."""
    n, start = 0, time.perf_counter()
    while True:
        for wt in weights:
            call(x, wt)
        n += len(weights)
        elapsed = time.perf_counter() - start
        if elapsed >= target_s:
            return elapsed / n * 1e6


def measure_shape(name: str, out: int, k: int, args, bar) -> list[dict]:
    w = pruned_weight(out, k, seed=out * 7 + k)
    built = makers(w)
    check(w, built)
    rows = []
    for where in args.where:
        stream = args.stream_mb * 2**20
        sets = {kern: copies_of(p, 1 if where == "cache" else max(1, -(-stream // nbytes)))
                for kern, (p, _, nbytes) in built.items()}
        for m in args.batches:
            x = torch.randn(m, k)
            runs = {kern: [] for kern in KERNELS}
            for kern in KERNELS:
                time_pass(built[kern][1], sets[kern], x, 0.0)            # page in, warm up
            for _ in range(args.rounds):
                for kern in KERNELS:
                    runs[kern].append(time_pass(built[kern][1], sets[kern], x,
                                                args.target_ms / 1e3))
                bar.update(1)
            for kern in KERNELS:
                us, nbytes = statistics.median(runs[kern]), built[kern][2]
                rows.append({"shape": name, "out": out, "in": k, "m": m, "where": where,
                             "threads": torch.get_num_threads(),
                             "kernel": kern, "us": round(us, 2), "bytes": nbytes,
                             "gb_s": round(nbytes / us / 1e3, 2),
                             "runs_us": [round(r, 2) for r in runs[kern]]})
        del sets
    return rows


def step_totals(rows: list[dict]) -> list[dict]:
    """SmolLM2-135M's whole decode step of linears (30 layers and the head), per kernel."""
    totals = {}
    for r in rows:
        if r["shape"] in PER_STEP:
            key = (r["where"], r["threads"], r["m"], r["kernel"])
            totals[key] = totals.get(key, 0.0) + PER_STEP[r["shape"]] * r["us"]
    return [{"where": w, "threads": t, "m": m, "kernel": kern, "step_us": round(us, 1)}
            for (w, t, m, kern), us in totals.items()]


def markdown(result: dict) -> str:
    lines = [f"{result['machine']['cpu']}, memory read {result['read_gb_s']} GB/s; median µs per call (GB/s of weight "
             f"bytes read); `2:4 / tiled`: the sparse kernel's time over the dense float32 "
             f"kernel's", ""]
    head = "| where | threads | M | shape | " + " | ".join(KERNELS) + " | 2:4 / tiled |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    cells = {(r["where"], r["threads"], r["m"], r["shape"], r["kernel"]): r
             for r in result["rows"]}
    for where, t, m in _order(result):
        for shape in result["shapes"]:
            got = [cells[(where, t, m, shape, k)] for k in KERNELS]
            ratio = got[-1]["us"] / got[0]["us"]
            lines.append(f"| {where} | {t} | {m} | {shape} | "
                         + " | ".join(f"{g['us']:.1f} ({g['gb_s']:.1f})" for g in got)
                         + f" | {ratio:.2f} |")
    lines += ["", "SmolLM2-135M's decode step, all linears (30 layers + head), µs:", "",
              "| where | threads | M | " + " | ".join(KERNELS) + " |",
              "|---|---|---|" + "---|" * len(KERNELS)]
    steps = {(s["where"], s["threads"], s["m"], s["kernel"]): s["step_us"]
             for s in result["step_totals"]}
    for key in _order(result):
        if (*key, KERNELS[0]) in steps:
            lines.append("| " + " | ".join(map(str, key)) + " | "
                         + " | ".join(f"{steps[(*key, k)]:.0f}" for k in KERNELS) + " |")
    return "\n".join(lines)


def _order(result: dict) -> list[tuple]:
    return [(w, t, m) for w in result["where"] for t in result["threads"]
            for m in result["batches"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--where", default="memory,cache", help="memory, cache or both")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names from: " + ", ".join(SHAPES))
    ap.add_argument("--threads", default=None, help="thread counts, e.g. 1,2 (torch's own)")
    ap.add_argument("--stream-mb", type=int, default=128,
                    help="bytes of weight copies each candidate cycles through from memory")
    ap.add_argument("--target-ms", type=float, default=20.0, help="time per candidate a round")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    args = ap.parse_args(argv)
    if not sparse24.available():
        print("kvslim's kernels are not built here (KVSLIM_NO_EXTENSION or no compiler)",
              file=sys.stderr)
        return 1
    args.batches = [int(b) for b in args.batches.split(",")]
    args.where = args.where.split(",")
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else [torch.get_num_threads()])
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    rows = []
    total = len(threads) * len(shapes) * len(args.where) * len(args.batches) * args.rounds
    with torch.inference_mode(), tqdm(total=total, desc="rounds", file=sys.stderr) as bar:
        for t in threads:
            torch.set_num_threads(t)
            for name, (out, k) in shapes.items():
                rows += measure_shape(name, out, k, args, bar)
    result = {"machine": machine_info().to_dict(), "read_gb_s": memory_bandwidth().read_gb_s,
              "rounds": args.rounds, "where": args.where, "threads": threads, "batches": args.batches,
              "shapes": list(shapes), "stream_mb": args.stream_mb, "rows": rows,
              "step_totals": step_totals(rows)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
