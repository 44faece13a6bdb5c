"""`kvslim quantize`: 4- or 8-bit weight-only quantization (RTN, GPTQ or AWQ), written in the
GPTQ checkpoint layout, or W8A8 (int8 weights and per-token int8 activations, optionally
SmoothQuant), written in the compressed-tensors int-quantized layout
(docs/quantization-formats.md)."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model's linear layers to 4 or 8 bits "
                                        "(RTN, GPTQ or AWQ), written as a GPTQ checkpoint")
    p.add_argument("src", metavar="SRC", help="source model directory (not quantized)")
    p.add_argument("dst", metavar="DST", help="output model directory")
    p.add_argument("--method", default="gptq",
                   help="rtn (round to nearest), gptq, awq (activation-aware scales folded into "
                        "the weights, then rtn), or int8 (= rtn --bits 8 --group-size -1 "
                        "--sym: one scale per output channel, run by the int8 kernel), or w8a8 "
                        "(int8 weights per output channel and int8 activations per token, "
                        "compressed-tensors layout)")
    p.add_argument("--bits", type=int, default=4, help="4 or 8")
    p.add_argument("--group-size", type=int, default=128,
                   help="input channels per scale and zero point; must divide every linear "
                        "layer's input features (-1: one group per output channel)")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                   help="symmetric grid (zero point in the middle); --no-sym fits each group")
    p.add_argument("--act-order", action="store_true",
                   help="GPTQ: quantize columns by decreasing Hessian diagonal (desc_act)")
    p.add_argument("--awq-clip", action=argparse.BooleanOptionalAction, default=True,
                   help="AWQ: also search each group's clipping range (--no-awq-clip: scales only)")
    p.add_argument("--smooth-alpha", type=float, default=None,
                   help="w8a8: SmoothQuant's migration strength in [0, 1] (0.5 is usual); "
                        "needs --calib. Without it: plain W8A8, no calibration")
    p.add_argument("--calib", help="calibration text file (needed by --method gptq and awq, "
                                   "and by --smooth-alpha)")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_quantize)


def run_quantize(args) -> int:
    from kvslim.quantization import QuantSpec
    from kvslim.quantization.w8a8 import W8A8_SPEC
    from kvslim.surgery.quantize.model import quantize_model
    from kvslim.errors import KvslimError
    from kvslim.surgery.quantize.model import METHODS
    if args.method == "w8a8":
        return _run_w8a8(args, W8A8_SPEC)
    if args.method not in (*METHODS, "int8"):
        raise KvslimError(f"unknown --method {args.method!r}; choose one of "
                          f"{', '.join((*METHODS, 'int8'))}")
    if args.method == "int8":
        args.method, args.bits, args.group_size, args.sym = "rtn", 8, -1, True
    # A symmetric grid's zero point is never 0, which v1's "zero - 1" stores exactly; an
    # asymmetric one may be, so it is written as gptq_v2 (the zero point as is).
    spec = QuantSpec(args.bits, args.group_size, args.act_order, args.sym,
                     "gptq" if args.sym else "gptq_v2")
    out = quantize_model(args.src, args.dst, args.method, spec, args.calib, args.calib_samples,
                         args.seq_len, show_progress=not args.quiet,
                         awq_clip=args.awq_clip, smooth_alpha=args.smooth_alpha)
    print(f"wrote {out} ({args.method}, {args.bits}-bit, group size {args.group_size}, "
          f"{'symmetric' if args.sym else 'asymmetric'}{', act-order' if args.act_order else ''}"
          f"{', no clipping' if args.method == 'awq' and not args.awq_clip else ''})")
    return 0


def _run_w8a8(args, spec) -> int:
    from kvslim.surgery.quantize.model import quantize_model
    out = quantize_model(args.src, args.dst, "w8a8", spec, args.calib, args.calib_samples,
                         args.seq_len, show_progress=not args.quiet,
                         smooth_alpha=args.smooth_alpha)
    smooth = ("" if args.smooth_alpha is None
              else f", SmoothQuant alpha {args.smooth_alpha:g}")
    print(f"wrote {out} (w8a8: int8 weights per output channel, int8 activations per "
          f"token{smooth})")
    return 0
