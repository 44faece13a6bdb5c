"""`kvslim ppl`: the weights as loaded, or the engine's kernels with float32 or int8 activations."""
import json

import pytest

from kvslim.cli.main import main
from kvslim.kernels import group_q8, tiled_gemm


def ppl(capsys, *argv) -> float:
    assert main(["ppl", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["perplexity"]


def test_ppl_scores_the_kernels_it_is_asked_for(hf_checkpoints, tmp_path, capsys):
    q4 = tmp_path / "q4"
    assert main(["quantize", str(hf_checkpoints["gqa"]), str(q4), "--method", "rtn",
                 "--group-size", "32", "--quiet"]) == 0
    capsys.readouterr()
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = (q4, "--data", text, "--context", "64", "--stride", "32")
    dequantized = ppl(capsys, *args)
    if not tiled_gemm.available():
        pytest.skip("without kvslim's kernels the 4-bit layers multiply in bfloat16")
    as_engine = ppl(capsys, *args, "--linear-activations", "float32")
    assert as_engine == pytest.approx(dequantized, rel=1e-4)    # float32 kernels: exact sums
    if not group_q8.available():
        pytest.skip("int8 activations need an AVX-512 VNNI CPU")
    int8 = ppl(capsys, *args, "--linear-activations", "int8")
    assert int8 != as_engine and int8 == pytest.approx(as_engine, rel=0.05)
