"""The decode step compiled on the CPU: the counterpart of CUDA graphs (and, on CUDA, what they
record: decode_graphs.py).

A decode step of a small model on the CPU spends much of its time between the kernels: Python
dispatch of a few hundred small operations (norms, RoPE, residuals, the cache writes, the
attention gathers). torch.compile with Inductor's C++ backend traces the whole decoder of a
padded decode batch (decode_graphs.py's static buffers) into one program: the exactly rounded
glue fused into C++ loops; the matmuls, and every op Inductor would round differently
(compile_numerics.py), called as the same kernels eager runs, so a compiled step's logits are
those of the same padded step run eagerly, to the last bit (MoE layers aside: compiled, every
expert runs on every row).

The step is compiled with dynamic shapes: one program for every padded batch from 2 rows and
every block-table width, and one for a single row (torch specializes a size of 1), so start-up
compiles two programs rather than one per shape (a program of SmolLM2-135M's 30 layers takes
minutes to compile on 2 cores). Enough padded shapes to meet every guard run once at
start-up (decode_graphs.py); afterwards the
engine never compiles (a shape no program covers runs eagerly). Inductor's caches (the FX graph
cache and AOTAutograd's: whole programs, keyed by the graph, the shapes and the torch version)
live under kvslim's home in a folder named by the torch and kvslim versions and the numerics
list, so a second start loads the programs the first built (it still traces the model).
Anything that stops the compiler (no C++ compiler, a failed build) leaves the eager path, with
a one-line note."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

import kvslim
from kvslim.engine import compile_numerics
from kvslim.kernels import extension
from kvslim.kernels.extension import note  # noqa: F401 - the engine's too
from kvslim.paths import kvslim_home

# What builds the programs: Inductor; "aot_eager" (or any backend, by name or as a function)
# traces the same graph and runs it with eager kernels (the tests use it to check tracing and
# guards without minutes of C++ builds).
BACKEND = "inductor"
RECOMPILE_LIMIT = 1024


def missing_compiler(device: torch.device) -> str | None:
    """Why Inductor cannot build the step for `device` here, or None: its C++ on the CPU,
    Triton on CUDA."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        return None if has_triton() else "no Triton for this GPU"
    return extension.missing_compiler()


def first_line(error: BaseException) -> str:
    """The root cause of a compiler failure, in one line: torch wraps a backend's exception
    in its own, whose message starts with a header."""
    while (inner := error.__cause__ or getattr(error, "inner_exception", None)) is not None:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def cache_folder_name() -> str:
    return (f"torch-{torch.__version__}-kvslim-{kvslim.__version__}-"
            f"{compile_numerics.fingerprint()}")


def use_compile_cache() -> Path | None:
    """Point Inductor's on-disk caches at kvslim's compile folder (unless the user chose one
    with TORCHINDUCTOR_CACHE_DIR); None when the user's choice stands. A folder that cannot be
    written is replaced by a fresh temporary one, with a note; caches of other versions are
    left alone and not read."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # torch writes its default into the environment when Inductor is imported: not a choice
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return None
    root = kvslim_home() / "compile"
    folder = root / cache_folder_name()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder)
        probe.close()
    except OSError as e:
        folder = Path(tempfile.mkdtemp(prefix="kvslim-compile-"))
        note(f"compile cache {root} is not writable ({e.strerror}): compiling afresh into "
             f"{folder}")
    else:
        others = [p.name for p in root.iterdir() if p.is_dir() and p != folder]
        if others and not any(folder.iterdir()):
            note(f"compile cache of another torch/kvslim version ({', '.join(sorted(others))}) "
                 "not used: compiling afresh")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


class CompiledStep:
    """`fn(*tensors)` compiled by Inductor; `dynamic_dims[i]` are the dimensions of the i-th
    input whose size varies between calls (every other size, the weights' too, is fixed in the
    program: a program with every size symbolic takes many times longer to build, and runs
    generic code). A size of 1 is not marked: torch gives one row a program of its own, which
    keeps the eager path's one-row kernels (layers/cpu_linear.py). `compilations` counts the
    backend's calls (a cache hit too; dynamo may call it more than once for one program): what
    a test compares before and after serving. After `freeze()` a call no program covers runs
    `fn` eagerly instead of compiling."""

    def __init__(self, fn, dynamic_dims: tuple[tuple[int, ...], ...]):
        self.dynamic_dims = dynamic_dims
        self.compilations = 0
        self.frozen = False
        self._compiled = torch.compile(fn, backend=self._backend, fullgraph=True)

    def __call__(self, *tensors):
        for t, dims in zip(tensors, self.dynamic_dims):
            for d in dims:
                if t.shape[d] > 1:
                    torch._dynamo.mark_dynamic(t, d)
        if not self.frozen:
            # Each engine's step is the same code object with guards of its own: the engines
            # of a process (tests, benchmarks) add up past dynamo's default limit of 8.
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                            accumulated_recompile_limit=RECOMPILE_LIMIT):
                return self._compiled(*tensors)
        # Frozen: only the guards that tell the programs apart are checked (the inputs are the
        # same static buffers and weights every step; checking all of them cost ~4 ms a step).
        with torch.compiler.set_stance("eager_on_recompile", skip_guard_eval_unsafe=True):
            return self._compiled(*tensors)

    def _backend(self, gm, example_inputs):
        self.compilations += 1
        if BACKEND != "inductor":
            backend = BACKEND if callable(BACKEND) else torch._dynamo.lookup_backend(BACKEND)
            return backend(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx
        with compile_numerics.eager_kernels():
            return compile_fx(gm, example_inputs, config_patches=compile_numerics.CONFIG)

    def freeze(self) -> None:
        self.frozen = True
