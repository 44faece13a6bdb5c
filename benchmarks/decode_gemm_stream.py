"""A decode step's GEMMs as the model runs them: every layer's weight read once per step, from
memory, not from cache (`kvslim bench kernels` times one weight over and over, which a 32 MB
L3 keeps whole). Random group weights in SmolLM2-135M's shapes (30 layers of qkv, o, gate_up,
down; 4-bit, groups of 32, with offsets, as its Q4_1 file) and its tied LM head (8-bit,
groups of 16, as Q8_0 is stored), run by kvslim's two group kernels: float32 activations
(`group`, kernels/tiled_gemm.py, the engine's) and int8 activations per 32-block
(`q8`, kernels/group_q8.py, llama.cpp's arithmetic), the latter also as GGUF stores Q4_1 and
Q4_0 (`q4_1h`: float16 scales and offsets; `q4_0`: float16 scales, offsets of -8 * scale, which
the kernel streams none of); beside them the other two modes' weights: W8A8 (`w8a8`, int8 per channel, activations per token, group_q8.w8a8_mm) and
float32 (`f32`, tiled_gemm.float_linear), both with a float32 head as their checkpoints keep
it; and per M the read rate against the machine's measured bandwidth.

    python benchmarks/decode_gemm_stream.py [--batches 1,8,32] [--rounds 6] [--threads N]
        [--kernels q4_1h,q4_0]
        [--json] [--out docs/decode_gemm_stream.json] [--plot docs/img/decode_gemm_stream.png]

Each cell is the best of `--rounds` interleaved rounds (a shared machine's noise only slows a
round down)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvslim_lab.bench.machine import machine_info, memory_bandwidth
from kvslim.kernels import group_q8, tiled_gemm

LAYERS = 30
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD = (576, 49152)


def random_weight(bits: int, out: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (out, k), dtype=torch.uint8, generator=g)
        mins = torch.randn(out, k // group, generator=g) * 0.01
    else:
        q = torch.randint(-128, 128, (out, k), dtype=torch.int8, generator=g)
        mins = None
    return q, torch.rand(out, k // group, generator=g) * 0.01, mins


def _nbytes(w) -> int:
    if isinstance(w, tiled_gemm.FloatWeight):
        return w.tiles.nbytes
    return sum(t.nbytes for t in (w.qweight, w.scales, getattr(w, "mins", None),
                                  getattr(w, "colsum", None)) if t is not None)


def build(kernels: list[str]):
    """{kernel: (layer weights, head weight, layer bytes, head bytes)}: what the engine runs
    for each mode (W8A8 and float32 keep the tied head in float32, as their checkpoints do)."""
    raw = [random_weight(4, n, k, 32, seed=i * 4 + j)
           for i in range(LAYERS) for j, (k, n) in enumerate(SHAPES.values())]
    head = random_weight(8, HEAD[1], HEAD[0], 16, seed=-1)
    float_head = lambda: tiled_gemm.pack_float_weight(torch.randn(HEAD[1], HEAD[0]) * 0.02)
    makers = {
        "group": lambda: ([tiled_gemm.pack_group_weight(*w, 4) for w in raw],
                          tiled_gemm.pack_group_weight(*head, 8)),
        "q8": lambda: ([group_q8.pack_q8_weight(*w, 4) for w in raw],
                       group_q8.pack_q8_weight(*head, 8)),
        # As GGUF stores them: float16 scales, and offsets (Q4_1) or none (Q4_0: -8 * scale).
        "q4_1h": lambda: ([group_q8.pack_q8_weight(q, s.half().float(), m.half().float(), 4)
                           for q, s, m in raw], group_q8.pack_q8_weight(*head, 8)),
        "q4_0": lambda: ([group_q8.pack_q8_weight(q, s.half().float(), s.half().float() * -8, 4)
                          for q, s, _ in raw], group_q8.pack_q8_weight(*head, 8)),
        "w8a8": lambda: ([group_q8.pack_w8a8_weight(torch.randint(-127, 128, q.shape,
                                                                  dtype=torch.int8),
                                                    torch.rand(q.shape[0]) * 0.01)
                          for q, _, _ in raw], float_head()),
        "f32": lambda: ([tiled_gemm.pack_float_weight(torch.randn(q.shape) * 0.02)
                         for q, _, _ in raw], float_head())}
    built = {}
    for name in kernels:
        layers, h = makers[name]()
        built[name] = (layers, h, sum(_nbytes(w) for w in layers), _nbytes(h))
    return built


def step_time(run, layers, head, m: int) -> tuple[float, float]:
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    t = time.perf_counter()
    for w in layers:
        run(xs[w.in_features], w)
    mid = time.perf_counter()
    run(xs[576], head)
    return mid - t, time.perf_counter() - mid


def run_any(x, w):
    if isinstance(w, tiled_gemm.FloatWeight):
        return tiled_gemm.float_linear(x, w)
    if isinstance(w, tiled_gemm.GroupWeight):
        return tiled_gemm.group_linear(x, w)
    return group_q8.w8a8_mm(x, w) if w.per_row else group_q8.q8_linear(x, w)


def measure(batches, rounds: int, kernels: list[str]) -> dict:
    built = build(kernels)
    best = {}
    for _ in range(rounds):
        for m in batches:
            for name in kernels:
                layers, head = built[name][:2]
                step_time(run_any, layers, head, m)                 # page in, warm up
                lt, ht = step_time(run_any, layers, head, m)
                old = best.get((name, m), (float("inf"), float("inf")))
                best[(name, m)] = (min(old[0], lt), min(old[1], ht))
    rows = [{"kernel": name, "m": m, "layers_ms": lt * 1e3, "head_ms": ht * 1e3,
             "layer_mb": built[name][2] / 1e6, "head_mb": built[name][3] / 1e6,
             "layers_gb_s": built[name][2] / lt / 1e9, "head_gb_s": built[name][3] / ht / 1e9}
            for (name, m), (lt, ht) in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    return {"rows": rows}


LABELS = {"group": "Q4_1, float32 activations", "q8": "Q4_1, int8 activations",
          "q4_1h": "Q4_1 (float16 scales), int8 activations",
          "q4_0": "Q4_0 (no offsets), int8 activations",
          "w8a8": "W8A8 (per-token int8)", "f32": "float32 weights"}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({r["kernel"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["kernel"] == name]
        line, = ax.plot([r["m"] for r in rows], [r["layers_ms"] + r["head_ms"] for r in rows],
                        "o-", label=LABELS[name])
        floor = (rows[0]["layer_mb"] + rows[0]["head_mb"]) / result["read_gb_s"]
        ax.axhline(floor, ls="--", c=line.get_color(), lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="rows per step (M)",
           ylabel="ms per step (all GEMMs)",
           title=f"SmolLM2-135M GEMMs, weights from memory\n(dashed: the weights read at "
                 f"{result['read_gb_s']:.0f} GB/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kernels", default=None,
                    help="comma-separated subset of: group, q8, q4_1h, q4_0, w8a8, f32")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--plot", default=None, help="a PNG of step time per M, per kernel")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not tiled_gemm.available():
        print("kvslim's kernels are not built here (KVSLIM_NO_EXTENSION or no compiler)",
              file=sys.stderr)
        return 1
    kernels = args.kernels.split(",") if args.kernels else (
        ["group"] + (["q8", "q4_1h", "q4_0", "w8a8"] if group_q8.available() else []) + ["f32"])
    result = measure([int(b) for b in args.batches.split(",")], args.rounds, kernels)
    result["machine"] = machine_info().to_dict()
    result["read_gb_s"] = memory_bandwidth().read_gb_s
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"memory read {result['read_gb_s']:.1f} GB/s, {torch.get_num_threads()} threads")
    print(f"{'kernel':7} {'M':>3} {'layer MB':>9} {'layers ms':>10} {'GB/s':>6} {'head MB':>8} "
          f"{'head ms':>8} {'GB/s':>6}")
    for r in result["rows"]:
        print(f"{r['kernel']:7} {r['m']:>3} {r['layer_mb']:>9.1f} {r['layers_ms']:>10.2f} "
              f"{r['layers_gb_s']:>6.1f} {r['head_mb']:>8.1f} {r['head_ms']:>8.2f} "
              f"{r['head_gb_s']:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
