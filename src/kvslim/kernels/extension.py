"""kvslim's own CPU kernels (csrc/), built on first use with torch.utils.cpp_extension and
cached under kvslim's home.

Built on first use rather than by the package's install: a build-time torch requirement would
make pip's isolated build environment fetch a CUDA torch instead of the pinned CPU one. The
build takes the host's instruction set (-march=native: AVX-512, AVX2 or plain C++, chosen by
the preprocessor in the source), so its folder is keyed by the sources, the flags, the torch
version and the CPU's feature flags: a second start, or a home shared by two machines, never
loads a build made for other sources or another CPU. A machine without a C++ compiler, a failed
build or `KVSLIM_NO_EXTENSION=1` leaves the pure-torch kernels, with a one-line note."""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from functools import cache
from pathlib import Path

import torch

from kvslim.paths import kvslim_home

DISABLE_ENV = "KVSLIM_NO_EXTENSION"
# KVSLIM_KERNEL_ISA=avx2 or scalar builds the narrower paths on a wider CPU: what a machine
# without AVX-512 (or without x86 vectors) runs, checked here (tests/kernels/test_isa_builds.py).
ISA_ENV = "KVSLIM_KERNEL_ISA"
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "scalar": ("-mno-avx", "-mno-avx2",
                                                                  "-mno-fma", "-mno-avx512f")}
# One translation unit (all_kernels.cpp includes the others: torch's headers parsed once).
SOURCES = ("all_kernels.cpp",)
# Not compiled on their own, but part of what a build is.
HEADERS = ("tiled_gemm.cpp", "group_sums.cpp", "group_q8.cpp", "paged_attention.cpp",
           "store_slots.cpp", "sparse24_gemm.cpp", "head_mm.cpp", "decoder_layer.cpp",
           "lora_sgmv.cpp", "group_sums.h", "thread_team.h", "vec_tree.h")
# -ffp-contract=off: the source says where a multiply and an add fuse; the compiler may not
# fuse others (the group sums), so every build runs the same arithmetic.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-fast-math")
NAME = "kvslim_kernels"


def note(message: str) -> None:
    print(f"kvslim: {message}", file=sys.stderr)


def missing_compiler() -> str | None:
    """Why a C++ build cannot run here, or None."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None and shutil.which("c++") is None:
        return f"no C++ compiler found ({compiler}, c++)"
    return None


def _find_ninja() -> str | None:
    """cpp_extension runs `ninja` from PATH; the pip package puts it beside this Python, which
    is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        beside = Path(sys.executable).parent
        if (beside / "ninja").exists():
            os.environ["PATH"] = f"{beside}{os.pathsep}{os.environ.get('PATH', '')}"
    return None if shutil.which("ninja") else "ninja not found (pip install ninja)"


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip() not in ("", "0")


def source_dir() -> Path:
    return Path(__file__).resolve().parent / "csrc"


def cpu_fingerprint() -> str:
    """The CPU's feature flags (Linux), else the processor's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cflags() -> list[str]:
    isa = os.environ.get(ISA_ENV, "native").strip() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    on_x86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
    return list(CFLAGS) + (list(ISA_FLAGS[isa]) if on_x86 else [])


def build_key() -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((source_dir() / name).read_bytes())
    digest.update(" ".join(cflags()).encode())
    digest.update(cpu_fingerprint().encode())
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"torch-{torch.__version__}-{python}-{digest.hexdigest()[:16]}"


def build_dir() -> Path:
    return kvslim_home() / "kernels" / build_key()


@cache
def load() -> str | None:
    """Builds (first use) and loads the extension; why it is not available, or None."""
    if disabled():
        return f"{DISABLE_ENV} is set"
    missing = missing_compiler() or _find_ninja()
    if missing is not None:
        return missing
    from torch.utils import cpp_extension
    try:
        out = build_dir()
    except ValueError as e:                      # a KVSLIM_KERNEL_ISA it does not know
        return str(e)
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.glob(f"{NAME}*.so")):
        note(f"building kvslim's CPU kernels into {out} (once per machine and version) ...")
    try:
        cpp_extension.load(name=NAME, sources=[str(source_dir() / s) for s in SOURCES],
                           extra_cflags=cflags(), build_directory=str(out),
                           is_python_module=False, verbose=False)
    except Exception as e:                       # noqa: BLE001 - any failure: the torch kernels
        lines = str(e).strip().splitlines()
        return f"the build failed: {type(e).__name__}: {lines[0][:200] if lines else ''}"
    return None


@cache
def available() -> bool:
    """Whether torch.ops.kvslim's kernels can run; a one-line note the first time they cannot."""
    reason = load()
    if reason is not None and not disabled():
        note(f"using the pure-torch kernels: {reason}")
    return reason is None


_FAKES: set[str] = set()


def ensure(fakes: dict) -> bool:
    """`available()`, with each op's fake (its output shapes, for torch.compile's tracing)
    registered once: op name -> function of the op's arguments."""
    if not available():
        return False
    for name, fake in fakes.items():
        if name not in _FAKES:
            torch.library.register_fake(f"kvslim::{name}")(fake)
            _FAKES.add(name)
    return True


def isa() -> str | None:
    """The instruction set the loaded build uses (avx512, avx2, scalar), None without one."""
    return torch.ops.kvslim.kernels_isa() if available() else None


class ResolvedOnce:
    """Whether the extension, with these ops' fakes, is built: asked once (eagerly, where the
    kernel's layer is prepared), then a plain bool that a compiled step can read, where tracing
    `ensure` would stop at its file-system calls and lose the whole graph."""

    def __init__(self, fakes: dict):
        self.fakes, self.value = fakes, None

    def __call__(self) -> bool:
        if self.value is None:
            self.value = ensure(self.fakes)
        return self.value
