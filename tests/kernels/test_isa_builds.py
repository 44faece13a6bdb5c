"""The kernels' narrower paths, which a machine without AVX-512 (AVX2 only) or without x86
vectors (scalar) runs: on this CPU, builds made with KVSLIM_KERNEL_ISA=avx2 / scalar pass the
float-activation GEMM's, the decode attention's and the cache writes' own tests (the reference
within its bound, rows bit-identical across M, the batch and the threads). The int8-activation
kernel has an AVX-512 VNNI path only: there its tests skip and the engine keeps float32."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvslim.kernels import extension

HERE = Path(__file__).parent
TESTS = ("test_tiled_gemm.py", "test_paged_attention.py", "test_store_slots.py",
         "test_group_q8.py", "test_sparse24.py")

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="the narrower builds are x86 flags")


def test_an_unknown_isa_is_named(monkeypatch):
    monkeypatch.setenv(extension.ISA_ENV, "avx9")
    assert extension.load.__wrapped__() == (
        "KVSLIM_KERNEL_ISA must be one of native, avx2, scalar, got 'avx9'")


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_a_narrower_build_passes_the_kernels_tests(isa, tmp_path):
    if extension.isa() == isa:
        pytest.skip(f"this host's own build is already {isa}: the suite ran its tests")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVSLIM_TEST"))}
    env.update({extension.ISA_ENV: isa, "KVSLIM_TEST_HOME": str(tmp_path / "home"),
                "KVSLIM_TEST_THREADS": "2"})
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                          "no:cacheprovider", *[str(HERE / t) for t in TESTS]],
                         env=env, capture_output=True, text=True, cwd=HERE.parents[1])
    summary = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in summary and "failed" not in summary, summary
