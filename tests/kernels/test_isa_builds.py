"""The kernels' narrower paths, which a machine without AVX-512 (AVX2 only) or without x86
vectors (scalar) runs: on this CPU, builds made with KVSLIM_KERNEL_ISA=avx2 / scalar pass the
float-activation GEMM's, the decode attention's, the cache writes' and the int8-activation
GEMM's own tests (the reference within its bound, rows bit-identical across M, the batch and the
threads); and the int8-activation GEMM gives the same bits in every build (its integer sums are
exact, its float steps one order in all of them)."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvslim.kernels import extension

HERE = Path(__file__).parent
TESTS = ("test_tiled_gemm.py", "test_paged_attention.py", "test_store_slots.py",
         "test_group_q8.py", "test_sparse24.py", "test_lora_sgmv.py")

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



def q8_bits() -> dict:
    """The int8-activation kernel's outputs on fixed weights and inputs, by case, and its ISA."""
    from group_weights import weight
    from kvslim.kernels import group_q8
    assert group_q8.available()
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5)) * 3
    out = {}
    for bits, group in ((4, 32), (8, 16), (4, 128)):
        q, scales, mins = weight(bits, 45, 256, group, seed=bits + group)
        packed = group_q8.pack_q8_weight(q, scales, mins, bits)
        out[f"{bits}-{group}"] = torch.cat([group_q8.q8_linear(x[:m], packed) for m in (1, 2, 9)])
    q, scales, mins = weight(4, 45, 256, 32, seed=11)             # float16 scales and offsets
    packed = group_q8.pack_q8_weight(q, scales.half().float(), mins.half().float(), 4)
    assert packed.scales.dtype == torch.float16
    out["4-32-half"] = torch.cat([group_q8.q8_linear(x[:m], packed) for m in (1, 2, 9)])
    for group in (32, 128):                                       # Q4_0's form: no offsets
        q, scales, _ = weight(4, 45, 256, group, seed=12 + group)
        packed = group_q8.pack_q8_weight(q, scales, scales * -8, 4)
        assert packed.mins is None
        out[f"4-{group}-q4_0"] = torch.cat([group_q8.q8_linear(x[:m], packed) for m in (1, 2, 9)])
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (45, 256), dtype=torch.int8, generator=g)
    out["w8a8"] = group_q8.w8a8_mm(x, group_q8.pack_w8a8_weight(q, torch.rand(45, generator=g)))
    out["isa"] = group_q8.isa()
    return out


def _q8_bits_of_build(isa: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVSLIM_TEST"))}
    env.update({extension.ISA_ENV: isa, "KVSLIM_HOME": str(tmp_path / f"home-{isa}")})
    out = tmp_path / f"{isa}.pt"
    code = (f"import sys, torch; sys.path.insert(0, {str(HERE)!r}); "
            f"from test_isa_builds import q8_bits; torch.save(q8_bits(), {str(out)!r})")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


def test_the_int8_activation_kernel_gives_the_same_bits_in_every_build(tmp_path):
    """This host's build (run here) against each narrower one (built in a subprocess)."""
    native = q8_bits()
    for isa in ("avx2", "scalar"):
        if native["isa"] == isa:
            continue
        narrow = _q8_bits_of_build(isa, tmp_path)
        assert narrow["isa"] == isa
        for name, y in native.items():
            if name != "isa":
                assert torch.equal(narrow[name], y), (isa, name)
