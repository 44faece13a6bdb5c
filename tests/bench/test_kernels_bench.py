"""`kvslim bench kernels` in a tiny mode: every candidate computes what its reference computes
(correctness, not speed: no time is asserted). The bound is the candidate's own `rtol` on
max |out - ref| / max |ref|: 1e-4 for kernels that run the same arithmetic in another order,
1e-3 for float-emulated W8A8 (integer sums beyond 2^24 round in float32), and for torchao
(its own scales, checked against the float weight) 2e-2 int8, 5e-2 W8A8, 0.2 int4; for the
group-wise int8 forms 1e-2 for bfloat16 weights and 5e-2 for the per-channel requantization
(both measured against the exact block weights)."""
import json
import subprocess
import sys

import pytest
import torch

from kvslim_lab.bench.kernel_candidates import build_candidates
from kvslim_lab.bench.kernels import format_kernels, parse_shapes, run_kernels

TINY = {"tiny": (128, 96)}


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
def test_every_candidate_matches_its_reference(rows):
    torch.manual_seed(0)
    w = torch.randn(96, 128) / 128 ** 0.5
    skipped = {}
    cands = build_candidates(w, (32, 64), compile_=False, torchao=True, skipped=skipped)
    families = {c.family for c in cands}
    assert {"fp32", "int8", "int4-g32", "int4-g64", "w8a8", "int8-g32", "int8-g16"} <= families
    x = torch.randn(rows, 128)
    with torch.inference_mode():
        for c in cands:
            out, ref = c(x), c.reference(x)
            assert out.shape == (rows, 96), c.name
            err = float((out - ref).abs().max() / ref.abs().max())
            assert err <= c.rtol, f"{c.name}: {err:.2e} > {c.rtol:.0e}"


def test_run_reports_every_candidate_and_compiled_ones_are_right():
    r = run_kernels(TINY, batches=(1, 5), groups=(32,), rounds=2, target_ms=0.5,
                    compile_=True, torchao=False)
    assert {t.rows for t in r.timings} == {1, 5}
    wrong = [(t.candidate, t.rows, t.max_rel_err) for t in r.timings if t.us is None]
    assert not wrong, wrong
    names = {t.candidate for t in r.timings}
    assert {"int8.compiled_dequant", "int4-g32.compiled_unpack_dequant"} <= names
    assert all(len(t.runs_us) == 2 and t.gb_s > 0 and t.gop_s > 0 for t in r.timings)
    assert all(v > 0 for v in r.compile_s.values()) and r.torchao == "not requested"
    assert "tiny 128->96" in format_kernels(r)


def test_group_sizes_that_do_not_divide_are_skipped_with_a_reason():
    r = run_kernels({"odd": (96, 64)}, batches=(2,), groups=(32, 64), rounds=1,
                    target_ms=0.1, compile_=False, torchao=False)
    assert "int4-g64@96" in r.skipped
    assert any(t.family == "int4-g32" for t in r.timings)
    assert not any(t.family == "int4-g64" for t in r.timings)


def test_parse_shapes():
    assert parse_shapes("qkv,x=8:16") == {"qkv": (576, 960), "x": (8, 16)}
    assert len(parse_shapes(None)) == 5


def test_command_prints_json():
    out = subprocess.run(
        [sys.executable, "-m", "kvslim.cli.main", "bench", "kernels", "--json", "--shapes",
         "t=64:32", "--batches", "1,2", "--groups", "32", "--rounds", "1", "--target-ms", "0.1",
         "--no-compile", "--no-torchao", "--threads", "1"],
        capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert {t["rows"] for t in d["timings"]} == {1, 2}
    assert all(t["us"] for t in d["timings"])


def test_run_reports_choices_in_json():
    r = run_kernels(TINY, batches=(1, 4), groups=(32,), rounds=1, target_ms=0.2,
                    compile_=False, torchao=False)
    d = json.loads(json.dumps(r.to_dict()))
    assert [(c["shape"], c["rows"]) for c in d["choices"]] == [("tiny", 1), ("tiny", 4)]
    assert all(c["w8a8_layer"] in ("w8a8", "int8") and c["us"]["int4-g32"] > 0
               for c in d["choices"])
    assert "w8a8 layer (stored)" in format_kernels(r)
