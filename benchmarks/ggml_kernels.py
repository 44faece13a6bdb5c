"""ggml's CPU kernels (llama.cpp's, through the `ggml-python` package) as a candidate dependency
for kvslim's quantized GEMMs: a decode step's GEMMs on the same blocks, one against the other.

SmolLM2-135M's shapes (30 layers of qkv, o, gate_up, down and the tied 49,152-row head), every
weight read from memory once per step, not from cache. Random float32 weights are quantized by
ggml itself (`ggml_quantize_chunk`) to Q4_0 or Q4_1 layers and a Q8_0 head; kvslim runs the
very same blocks, decoded by its GGUF block reader (formats/gguf/blocks.py) and packed for its
int8-activation kernel (kernels/group_q8.py, the engine's default), as the engine does with a
GGUF file. ggml runs the whole step as one graph of mul_mats (`ggml_graph_compute_with_ctx`,
as llama.cpp computes a step: its thread team held for the graph); kvslim runs its kernels one
call each from Python (the engine's native stack calls the same kernels from C++).

Reported per M (rows per step) and format: ms for the layers and for the head, read GB/s, and
two facts that decide whether ggml could be taken as a dependency:
- `max_abs_diff`: ggml's output against kvslim's on the same blocks and inputs (both quantize
  the activations to 8 bits per block of 32; they differ in float rounding order only);
- `batch_invariant`: whether ggml's row 0 at M = 8 is bit for bit its row 0 alone (kvslim's
  kernels are, by construction and by test).

    pip install ggml-python==0.0.45        # builds ggml from source, a minute or two
    python benchmarks/ggml_kernels.py [--batches 1,8] [--rounds 5] [--threads 2] [--json]
        [--out docs/ggml_kernels.json]

Not in ggml's plain context: llama.cpp's load-time repacking of Q4_0 into interleaved rows
(its CPU_REPACK buffer type, which llama-bench uses on AVX2); its batch-1 speed on the Q4_0
file (docs/peers-cpu-round3) is the repacked one."""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvslim_lab.bench.machine import machine_info, memory_bandwidth
from kvslim.formats.gguf.blocks import decode_blocks
from kvslim.kernels import group_q8

LAYERS = 30
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD = (576, 49152)
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def ggml_module():
    try:
        import ggml
    except ImportError:
        sys.exit("ggml-python is not installed: pip install ggml-python==0.0.45")
    return ggml


class GgmlStep:
    """A step's weights in one ggml context, and graphs of mul_mats over them per M."""

    def __init__(self, ggml, layer_type: str, seed: int = 0):
        self.ggml = ggml
        weights = [(k, n) for _ in range(LAYERS) for k, n in SHAPES.values()]
        nbytes = sum(ggml.ggml_row_size(GGML_TYPES[layer_type], k) * n for k, n in weights)
        nbytes += ggml.ggml_row_size(GGML_TYPES["Q8_0"], HEAD[0]) * HEAD[1]
        params = ggml.ggml_init_params(mem_size=nbytes + (256 << 20), mem_buffer=None)
        self.ctx = ggml.ggml_init(params)
        rng = np.random.default_rng(seed)
        self.layers = [self._quantized(layer_type, k, n, rng) for k, n in weights]
        self.head = self._quantized("Q8_0", *HEAD, rng)
        self.layer_bytes = sum(ggml.ggml_nbytes(t) for t, _ in self.layers)
        self.head_bytes = ggml.ggml_nbytes(self.head[0])

    def _quantized(self, kind: str, k: int, n: int, rng):
        """A [n, k] weight quantized by ggml; also its raw blocks, for kvslim."""
        ggml = self.ggml
        data = (rng.standard_normal((n, k), dtype=np.float32) * 0.02)
        t = ggml.ggml_new_tensor_2d(self.ctx, GGML_TYPES[kind], k, n)
        ggml.ggml_quantize_chunk(GGML_TYPES[kind],
                                 data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                 ggml.ggml_get_data(t), 0, n, k, None)
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * ggml.ggml_nbytes(t)).from_address(
            ggml.ggml_get_data(t))).copy()
        return t, raw

    def graph(self, m: int):
        """(graph, layer inputs, head input, outputs): every layer and the head over M rows."""
        ggml = self.ggml
        xs = {k: ggml.ggml_new_tensor_2d(self.ctx, 0, k, m) for k in (576, 1536)}
        for x in xs.values():
            arr = np.ctypeslib.as_array((ctypes.c_float * (x.contents.ne[0] * m)).from_address(
                ggml.ggml_get_data(x)))
            arr[:] = np.random.default_rng(m).standard_normal(arr.size)
        gf = ggml.ggml_new_graph_custom(self.ctx, 4 * len(self.layers) + 16, False)
        outs = [ggml.ggml_mul_mat(self.ctx, t, xs[t.contents.ne[0]]) for t, _ in self.layers]
        head_out = ggml.ggml_mul_mat(self.ctx, self.head[0], xs[576])
        for o in outs + [head_out]:
            ggml.ggml_build_forward_expand(gf, o)
        return gf, xs, outs, head_out

    def timed(self, m: int, threads: int) -> tuple[float, float]:
        """(layers seconds, head seconds): the layers' graph and the head's, each computed once
        after a warm-up."""
        ggml = self.ggml
        gf_layers = ggml.ggml_new_graph_custom(self.ctx, 4 * len(self.layers) + 16, False)
        gf_head = ggml.ggml_new_graph_custom(self.ctx, 16, False)
        _, xs, outs, head_out = self.graph(m)
        for o in outs:
            ggml.ggml_build_forward_expand(gf_layers, o)
        ggml.ggml_build_forward_expand(gf_head, head_out)
        times = []
        for gf in (gf_layers, gf_head):
            ggml.ggml_graph_compute_with_ctx(self.ctx, gf, threads)
        for gf in (gf_layers, gf_head):
            t = time.perf_counter()
            ggml.ggml_graph_compute_with_ctx(self.ctx, gf, threads)
            times.append(time.perf_counter() - t)
        return times[0], times[1]

    def head_rows(self, x: np.ndarray, threads: int) -> np.ndarray:
        """The head over the rows of `x` [m, 576]: [m, 49152], ggml's float32 output."""
        ggml = self.ggml
        m = x.shape[0]
        xt = ggml.ggml_new_tensor_2d(self.ctx, 0, HEAD[0], m)
        np.ctypeslib.as_array((ctypes.c_float * x.size).from_address(ggml.ggml_get_data(xt)))[:] \
            = x.ravel()
        out = ggml.ggml_mul_mat(self.ctx, self.head[0], xt)
        gf = ggml.ggml_new_graph_custom(self.ctx, 16, False)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(self.ctx, gf, threads)
        return np.ctypeslib.as_array((ctypes.c_float * (m * HEAD[1])).from_address(
            ggml.ggml_get_data(out))).reshape(m, HEAD[1]).copy()


def kvslim_weight(kind: str, raw: np.ndarray, k: int, n: int):
    """ggml's blocks decoded as the GGUF importer decodes them, packed for group_q8."""
    blocks = decode_blocks(raw, kind, n, k)
    q, scales, mins = blocks["qvalues"], blocks["scales"][:, ::2], blocks["mins"][:, ::2]
    if kind == "Q8_0":                # w = s * (q - 128): the 8-bit kernel's signed values
        return group_q8.pack_q8_weight((q.to(torch.int16) - 128).to(torch.int8), scales, None, 8)
    return group_q8.pack_q8_weight(q, scales, mins, 4)


def kvslim_step(step: GgmlStep, layer_type: str):
    layers = [kvslim_weight(layer_type, raw, t.contents.ne[0], t.contents.ne[1])
              for t, raw in step.layers]
    return layers, kvslim_weight("Q8_0", step.head[1], *HEAD)


def kvslim_timed(layers, head, m: int) -> tuple[float, float]:
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    for _ in range(2):                                       # a warm-up, then the timed run
        t = time.perf_counter()
        for w in layers:
            group_q8.q8_linear(xs[w.in_features], w)
        mid = time.perf_counter()
        group_q8.q8_linear(xs[576], head)
        end = time.perf_counter()
    return mid - t, end - mid


def nbytes(w) -> int:
    return sum(t.nbytes for t in (w.qweight, w.scales, getattr(w, "mins", None),
                                  getattr(w, "colsum", None)) if t is not None)


def measure(batches: list[int], rounds: int, threads: int, formats: list[str]) -> dict:
    ggml = ggml_module()
    rows, checks = [], {}
    for kind in formats:
        step = GgmlStep(ggml, kind)
        layers, head = kvslim_step(step, kind)
        sizes = {"ggml": (step.layer_bytes, step.head_bytes),
                 "kvslim": (sum(nbytes(w) for w in layers), nbytes(head))}
        best = {}
        for _ in range(rounds):
            for m in batches:
                for engine in ("ggml", "kvslim"):
                    lt, ht = (step.timed(m, threads) if engine == "ggml"
                              else kvslim_timed(layers, head, m))
                    old = best.get((engine, m), (float("inf"), float("inf")))
                    best[(engine, m)] = (min(old[0], lt), min(old[1], ht))
        for (engine, m), (lt, ht) in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            lb, hb = sizes[engine]
            rows.append({"format": kind, "engine": engine, "m": m, "layers_ms": lt * 1e3,
                         "head_ms": ht * 1e3, "layer_mb": lb / 1e6, "head_mb": hb / 1e6,
                         "layers_gb_s": lb / lt / 1e9, "head_gb_s": hb / ht / 1e9})
        if not checks:
            checks = agreement(step, head, threads)
    return {"rows": rows, "checks": checks}


def agreement(step: GgmlStep, head, threads: int) -> dict:
    """The Q8_0 head on the same blocks: ggml against kvslim, and ggml's batch invariance."""
    x = np.random.default_rng(7).standard_normal((8, HEAD[0]), dtype=np.float32)
    ggml_rows = step.head_rows(x, threads)
    ggml_alone = step.head_rows(x[:1], threads)
    ours = group_q8.q8_linear(torch.from_numpy(x), head).numpy()
    ours_alone = group_q8.q8_linear(torch.from_numpy(x[:1]), head).numpy()
    scale = float(np.abs(ours).max())
    return {"max_abs_diff": float(np.abs(ggml_rows - ours).max()), "output_max_abs": scale,
            "ggml_batch_invariant": bool((ggml_rows[0] == ggml_alone[0]).all()),
            "ggml_rows_differing_bits": int((ggml_rows[0] != ggml_alone[0]).sum()),
            "kvslim_batch_invariant": bool((ours[0] == ours_alone[0]).all())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--formats", default="Q4_0,Q4_1")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not group_q8.available():
        print("kvslim's kernels are not built here (KVSLIM_NO_EXTENSION or no compiler)",
              file=sys.stderr)
        return 1
    result = measure([int(b) for b in args.batches.split(",")], args.rounds, args.threads,
                     args.formats.split(","))
    result["threads"] = args.threads
    result["machine"] = machine_info().to_dict()
    result["read_gb_s"] = memory_bandwidth().read_gb_s
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"memory read {result['read_gb_s']:.1f} GB/s, {args.threads} threads")
    print(f"{'format':6} {'engine':7} {'M':>3} {'layer MB':>9} {'layers ms':>10} {'GB/s':>6} "
          f"{'head MB':>8} {'head ms':>8} {'GB/s':>6}")
    for r in result["rows"]:
        print(f"{r['format']:6} {r['engine']:7} {r['m']:>3} {r['layer_mb']:>9.1f} "
              f"{r['layers_ms']:>10.2f} {r['layers_gb_s']:>6.1f} {r['head_mb']:>8.1f} "
              f"{r['head_ms']:>8.2f} {r['head_gb_s']:>6.1f}")
    print("same Q8_0 head blocks:", json.dumps(result["checks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
