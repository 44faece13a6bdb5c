"""kvslim's group kernel: the plain-torch reference of its arithmetic within a stated bound for
4- and 8-bit weights, every M in 1..64 and odd shapes; each row's bits independent of the
number of rows and of the row's place; the packing's errors; the pure-torch path when the
extension is disabled."""
import os
import subprocess
import sys

import pytest
import torch

from group_weights import weight
from kvslim.kernels import extension, tiled_gemm
from thread_counts import outputs_at_thread_counts

pytestmark = pytest.mark.skipif(extension.missing_compiler() is not None,
                                reason="no C++ compiler: the extension cannot build here")
# float32 sums of up to a few thousand products against float64: relative to the largest output.
BOUND = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built():
    assert tiled_gemm.available(), extension.load()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out,k,group", [(960, 576, 32), (33, 96, 16), (200, 160, 32),
                                         (1, 64, 32), (47, 48, 16)])
def test_the_kernel_matches_its_reference_at_every_row_count(bits, out, k, group):
    q, scales, mins = weight(bits, out, k, group)
    packed = tiled_gemm.pack_group_weight(q, scales, mins, bits)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    for m in range(1, 65):
        got = tiled_gemm.group_linear(x[:m], packed)
        ref = tiled_gemm.reference_group_linear(x[:m], q, scales, mins)
        assert got.shape == (m, out) and got.dtype == torch.float32
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < BOUND, (m, float(err))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_bits_do_not_depend_on_the_batch(bits):
    q, scales, mins = weight(bits, 100, 128, 32, seed=2)
    packed = tiled_gemm.pack_group_weight(q, scales, mins, bits)
    x = torch.randn(150, 128, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([tiled_gemm.group_linear(x[i:i + 1], packed) for i in range(len(x))])
    for m in (2, 3, 4, 5, 7, 8, 13, 64, 65, 150):        # every micro-kernel and a second chunk
        assert torch.equal(tiled_gemm.group_linear(x[:m], packed), alone[:m]), m
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(4))
    assert torch.equal(tiled_gemm.group_linear(x[order], packed), alone[order])


def test_the_threads_do_not_change_the_bits():
    q, scales, mins = weight(4, 512, 256, 32)
    packed = tiled_gemm.pack_group_weight(q, scales, mins, 4)
    x = torch.randn(9, 256)
    outs = outputs_at_thread_counts(lambda: tiled_gemm.group_linear(x, packed))
    assert torch.equal(outs[0], outs[1])


def test_other_dtypes_and_shapes_are_computed_in_float32():
    q, scales, mins = weight(8, 40, 64, 32)
    packed = tiled_gemm.pack_group_weight(q, scales, mins, 8)
    x = torch.randn(2, 3, 64)
    y = tiled_gemm.group_linear(x.bfloat16(), packed)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y, tiled_gemm.group_linear(x.bfloat16().float(), packed).bfloat16())
    assert tiled_gemm.group_linear(torch.empty(0, 64), packed).shape == (0, 40)


def test_bad_weights_are_refused_with_the_reason():
    q, scales, mins = weight(4, 16, 64, 32)
    with pytest.raises(ValueError, match="4- or 8-bit"):
        tiled_gemm.pack_group_weight(q, scales, mins, 2)
    with pytest.raises(ValueError, match="take mins"):
        tiled_gemm.pack_group_weight(q, scales, None, 4)
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        tiled_gemm.pack_group_weight(q, scales[:, :1].repeat(1, 3), mins[:, :1].repeat(1, 3), 4)
    packed = tiled_gemm.pack_group_weight(q, scales, mins, 4)
    with pytest.raises(RuntimeError, match="x must be 2-D float32"):
        torch.ops.kvslim.group_mm(torch.zeros(1, 64, dtype=torch.float64), packed.qweight,
                                  packed.scales, packed.mins, 4, 16)
    with pytest.raises(RuntimeError, match="weight shape does not match"):
        torch.ops.kvslim.group_mm(torch.zeros(1, 64), packed.qweight, packed.scales,
                                  packed.mins, 4, 40)


def test_the_build_is_keyed_by_sources_torch_and_cpu():
    key = extension.build_key()
    assert key.startswith(f"torch-{torch.__version__}-py") and key in str(extension.build_dir())
    assert extension.isa() in ("avx512", "avx2", "scalar")
    asked = os.environ.get(extension.ISA_ENV, "native")
    if asked != "native":                       # a narrower build asked for: that one runs
        assert extension.isa() == asked


def test_disabled_the_extension_leaves_the_torch_kernels(tmp_path):
    code = ("import torch\n"
            "from kvslim.kernels import tiled_gemm\n"
            "from kvslim.quantization.gguf_blocks import block_kernel, TYPE_IDS\n"
            "q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)\n"
            "s, m = torch.rand(32, 4), torch.rand(32, 4)\n"
            "s[:, 1::2], m[:, 1::2] = s[:, ::2], m[:, ::2]\n"
            "k = block_kernel(q, s, m, [TYPE_IDS['Q4_1']], [32], None)\n"
            "print(tiled_gemm.available(), k.func.__name__, tuple(k(torch.randn(2, 64)).shape))\n")
    env = dict(os.environ, KVSLIM_NO_EXTENSION="1", KVSLIM_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "_int4_forward", "(2,", "32)"]
    assert "kvslim:" not in out.stderr                 # asked for: no note
    assert not (tmp_path / "kernels").exists()          # nor a build


def test_a_failed_build_is_one_line(monkeypatch, tmp_path):
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(extension, "source_dir", lambda: tmp_path)
    monkeypatch.setattr(extension, "SOURCES", ("broken.cpp",))
    monkeypatch.setattr(extension, "HEADERS", ())
    monkeypatch.setenv("KVSLIM_HOME", str(tmp_path / "home"))
    reason = extension.load.__wrapped__()
    assert reason.startswith("the build failed: ") and "\n" not in reason


def test_no_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert extension.missing_compiler() == "no C++ compiler found (no-such-compiler, c++)"
    assert extension.load.__wrapped__() == "no C++ compiler found (no-such-compiler, c++)"
