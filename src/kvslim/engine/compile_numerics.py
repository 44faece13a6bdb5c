"""Eager's numbers inside a compiled program: the ops Inductor must not generate code for.

Inductor's C++ rounds differently from eager's kernels wherever a result is more than one
correctly rounded IEEE operation: transcendental functions (eager calls MKL's vector math, Inductor
its own SIMD code), reductions (another summation order), and the composites built on them
(softmax, GELU, norms). A greedy token can turn on the last bit of a logit, so the compiled step
would decode other tokens than the eager path (measured on SmolLM2-135M: greedy tokens apart at
batch 8). These ops therefore run as calls to eager's own kernels inside the program; the exactly
rounded arithmetic between them (add, mul, div, casts, comparisons, indexing) is still fused, and
`emulate_precision_casts` keeps every rounding to a low-precision dtype that eager does.
`tests/engine/test_compile_numerics.py` checks each op of the list bitwise against eager."""
from __future__ import annotations

from contextlib import contextmanager

import torch

aten = torch.ops.aten

TRANSCENDENTAL = ("exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan",
                  "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh",
                  "atanh", "erf", "erfc", "erfinv", "sigmoid", "pow", "sqrt", "rsqrt")
ACTIVATIONS = ("gelu", "silu", "mish", "softplus", "elu", "logit")
REDUCTIONS = ("sum", "mean", "prod", "var", "var_mean", "std", "_softmax", "_log_softmax",
              "logsumexp", "linalg_vector_norm", "cumsum", "cumprod", "native_layer_norm",
              "native_group_norm", "_native_batch_norm_legit_no_training")
EAGER_OPS = TRANSCENDENTAL + ACTIVATIONS + REDUCTIONS


def eager_overloads() -> list[torch._ops.OpOverload]:
    """Every overload of the ops in EAGER_OPS."""
    packets = [getattr(aten, name) for name in EAGER_OPS]
    return [getattr(p, o) for p in packets for o in p.overloads()]


CONFIG = {"emulate_precision_casts": True}


def fingerprint() -> str:
    """Names the list and the config: part of the compile cache's folder name, since Inductor's
    cache keys do not see the tables patched here."""
    import hashlib
    text = repr((EAGER_OPS, sorted(CONFIG.items())))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


@contextmanager
def eager_kernels():
    """While compiling: every op of EAGER_OPS stays whole (out of the decomposition table) and
    lowers to a call of its eager kernel. Inductor's tables are patched in place, not passed
    as arguments (a decomposition table of one's own makes a program uncacheable), and
    restored afterwards, so other programs of the process compile as they would."""
    from torch._inductor import lowering
    from torch._inductor.decomposition import select_decomp_table
    ops = eager_overloads()
    table = select_decomp_table()
    saved_decomps = {op: table.pop(op) for op in ops if op in table}
    saved = {op: lowering.lowerings.get(op) for op in ops}
    realized = set(lowering.needs_realized_inputs)
    try:
        for op in ops:
            lowering.needs_realized_inputs.add(op)
            lowering.lowerings[op] = lowering.fallback_handler(op, add_to_fallback_set=False)
        yield
    finally:
        table.update(saved_decomps)
        for op, fn in saved.items():
            if fn is None:
                lowering.lowerings.pop(op, None)
            else:
                lowering.lowerings[op] = fn
        lowering.needs_realized_inputs.clear()
        lowering.needs_realized_inputs.update(realized)
