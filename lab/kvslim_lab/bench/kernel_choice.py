"""Which kernel a quantized layer should run at each row count M, from `kvslim bench kernels`'
timings of the kernels kvslim ships (not the other candidates it measures):

    fp32   layers/cpu_linear.PackedCpuKernel: a GEMV over the input-major copy at one row,
           oneDNN's packed GEMM from two
    int8   kernels.int8_linear: _weight_int8pack_mm with bfloat16 activations
    int4   kernels.int4_linear: _weight_int4pack_mm_for_cpu with bfloat16 activations (GPTQ,
           AWQ); GGUF's 4-bit blocks run kvslim's group kernel (`int4-g<N>.kvslim_group`)
    int8-g<N>  GGUF's 8-bit blocks: kvslim's group kernel (kernels/tiled_gemm.py)
    w8a8   kernels.w8a8_linear: per-token int8 activations, torch._int_mm

For each shape and M it reports the shipped kernels' µs, which kernel a W8A8 model's layer
should run (W8A8, or int8 weight-only on the same int8 weight), next to the stored rule
(`W8A8_MIN_ROWS`), and how a 4-bit layer compares with float32 and with the large-M
alternatives measured for it (`int4-g<N>.bf16_copy_mm`, `.w8a8_per_group_int_mm`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from kvslim.quantization.kernels import W8A8_MIN_ROWS

INT4_ALTERNATIVES = ("kvslim_group", "bf16_copy_mm", "w8a8_per_group_int_mm")


def shipped_kernel(family: str, rows: int) -> str:
    """The candidate name of the kernel kvslim runs for `family` at `rows` rows."""
    if family == "fp32":
        return "fp32.mm_in_out" if rows == 1 else "fp32.onednn_packed"
    if family == "int8":
        return "int8.weight_int8pack_mm_bf16"
    if family == "w8a8":
        return "w8a8.int_mm"
    if family.startswith("int8-g"):
        return f"{family}.kvslim_group"
    return f"{family}.int4pack_mm_for_cpu_bf16"


@dataclass
class KernelChoice:
    shape: str
    rows: int
    us: dict[str, float | None]          # family (and int4 alternative) -> µs
    w8a8_layer: str | None               # "w8a8" or "int8": the faster on this M; None: unknown
    w8a8_stored: str                     # what W8A8Linear runs (W8A8_MIN_ROWS)

    def to_dict(self) -> dict:
        return asdict(self)


def choose(timings) -> list[KernelChoice]:
    """One KernelChoice per (shape, M) in `timings` (KernelTiming rows)."""
    by_name = {(t.shape, t.rows, t.candidate): t.us for t in timings}
    families = list(dict.fromkeys(t.family for t in timings))
    out = []
    for shape, rows in dict.fromkeys((t.shape, t.rows) for t in timings):
        us = {fam: by_name.get((shape, rows, shipped_kernel(fam, rows))) for fam in families}
        for fam in (f for f in families if f.startswith("int4")):
            us.update({f"{fam}.{alt}": by_name.get((shape, rows, f"{fam}.{alt}"))
                       for alt in INT4_ALTERNATIVES})
        w8a8, int8 = us.get("w8a8"), us.get("int8")
        layer = None if w8a8 is None or int8 is None else ("w8a8" if w8a8 <= int8 else "int8")
        out.append(KernelChoice(shape, rows, us, layer,
                                "w8a8" if rows >= W8A8_MIN_ROWS else "int8"))
    return out


def format_choices(choices: list[KernelChoice]) -> list[str]:
    if not choices:
        return []
    cols = list(choices[0].us)
    lines = ["", "shipped kernels per M, µs (a W8A8 layer's faster kernel, and what it runs):",
             f"{'shape':9}{'M':>4}" + "".join(f"{c:>{max(10, len(c) + 2)}}" for c in cols)
             + "   w8a8 layer (stored)"]
    for c in choices:
        cells = "".join(f"{'-' if c.us[k] is None else format(c.us[k], '.0f'):>{max(10, len(k) + 2)}}"
                        for k in cols)
        lines.append(f"{c.shape:9}{c.rows:>4}{cells}   {c.w8a8_layer or '-'} ({c.w8a8_stored})")
    return lines
