"""`kvslim import-gguf` and `kvslim info` through the real command line entry point."""
import json
import subprocess
import sys

from gguf_files import write_tiny_gguf
from kvslim.cli.main import main


def test_import_gguf_bad_file_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a gguf\n")
    result = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "import-gguf", str(bad),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a GGUF file" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_import_gguf_then_info(tmp_path, capsys):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    assert main(["import-gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "out"), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "GQA: 4 query heads, 2 KV heads, group size 2" in text


def test_info_json_on_smollm2(smollm2_dir, capsys):
    assert main(["info", str(smollm2_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["num_attention_heads"], info["num_key_value_heads"]) == (9, 3)
    assert (info["group_size"], info["attention_kind"], info["head_dim"]) == (3, "GQA", 64)
    assert info["kv_cache_dtype"] == "float32"                 # the stored dtype by default
    assert info["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert 134e6 < info["num_parameters"] < 135e6               # SmolLM2-135M, tied head
    assert main(["info", str(smollm2_dir), "--json", "--dtype", "bfloat16"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2


def test_info_names_the_quantization(hf_checkpoints, tmp_path, capsys):
    assert main(["info", str(hf_checkpoints["gqa"])]) == 0
    assert "quantization      none (float weights)" in capsys.readouterr().out
    out = tmp_path / "q"
    assert main(["quantize", str(hf_checkpoints["gqa"]), str(out), "--method", "rtn", "--bits",
                 "4", "--group-size", "32", "--no-sym", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == \
        "4-bit asymmetric, groups of 32 (gptq, stored as gptq_v2)"


def test_info_errors(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "model not found" in capsys.readouterr().err
    write_tiny_gguf(tmp_path / "tiny.gguf")
    assert main(["import-gguf", str(tmp_path / "tiny.gguf"), str(tmp_path / "out"), "--quiet"]) == 0
    assert main(["info", str(tmp_path / "out"), "--dtype", "int3"]) == 2
    assert "unknown dtype 'int3'" in capsys.readouterr().err


def test_info_counts_the_int8_cache_with_its_scales(hf_checkpoints, capsys):
    assert main(["info", str(hf_checkpoints["gqa"]), "--dtype", "int8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # 2 layers x K/V x 2 KV heads: head_dim 8 int8 elements + one float16 scale each
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * (8 + 2)
    assert info["kv_cache_dtype"] == "int8"


def test_import_gguf_quantized_only_is_a_one_line_error(tmp_path, capsys):
    from gguf import GGMLQuantizationType as Q
    write_tiny_gguf(tmp_path / "q5.gguf", qtype=Q.Q8_0, types={"attn_k": Q.Q5_1})
    assert main(["import-gguf", str(tmp_path / "q5.gguf"), str(tmp_path / "out"), "--quiet",
                 "--dtype", "quantized"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor 'blk.0.attn_k.weight' is Q5_1" in err[0]
    assert not (tmp_path / "out").exists()
