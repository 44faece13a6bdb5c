"""`kvslim prune`: zero a fraction of every decoder linear's weights (magnitude, Wanda or
SparseGPT; unstructured or N:M), optionally quantizing the kept ones to 4 or 8 bits."""
from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    p = sub.add_parser("prune", help="prune a model's linear layers (magnitude, wanda, "
                                     "sparsegpt), unstructured or N:M, optionally + 4-bit")
    p.add_argument("src", metavar="SRC", help="source model directory (float, not pruned)")
    p.add_argument("dst", metavar="DST", help="output model directory")
    p.add_argument("--method", default="sparsegpt", help="magnitude, wanda or sparsegpt")
    p.add_argument("--sparsity", type=float, help="fraction of each row's weights to prune, "
                                                  "in (0, 1)")
    p.add_argument("--pattern", help="N:M instead: keep N of every M consecutive inputs "
                                     "(2:4, 4:8)")
    p.add_argument("--bits", type=int, help="also quantize the kept weights (4 or 8): "
                                            "sparsegpt jointly, the others round to nearest; "
                                            "written in the GPTQ layout")
    p.add_argument("--group-size", type=int, default=128,
                   help="with --bits: input channels per scale (-1: one per output row)")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                   help="with --bits: symmetric grid")
    p.add_argument("--format", default="dense", choices=("dense", "compressed-tensors"),
                   help="dense: float weights (with --bits: the GPTQ layout); "
                        "compressed-tensors: bitmask-compressed (sparse-24-bitmask for 2:4, "
                        "sparse-bitmask otherwise), with --bits 8 --group-size -1 as W8A8 "
                        "int-quantized, with --bits 4 pack-quantized")
    p.add_argument("--calib", help="calibration text file (wanda and sparsegpt)")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=run_prune)


def run_prune(args) -> int:
    from kvslim.quantization import QuantSpec
    from kvslim.surgery.prune.masks import SparsityTarget
    from kvslim.surgery.prune.model import prune_model
    target = SparsityTarget.parse(args.sparsity, args.pattern)
    spec = None
    if args.bits is not None:
        spec = QuantSpec(args.bits, args.group_size, False, args.sym,
                         "gptq" if args.sym else "gptq_v2")
    out = prune_model(args.src, args.dst, args.method, target, spec, args.calib,
                      args.calib_samples, args.seq_len, show_progress=not args.quiet,
                      output_format=args.format)
    summary = {"out": str(out), "method": args.method, "target": str(target),
               "bits": args.bits, "format": args.format}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {out} ({args.method}, {target}"
              f"{'' if args.bits is None else f', {args.bits}-bit kept weights'})")
    return 0
