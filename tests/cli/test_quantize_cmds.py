"""`kvslim quantize`: bad input is one line naming the problem and exit 2; good input writes a
GPTQ checkpoint that loads."""
import json

import pytest
import torch

from kvslim.cli.main import main
from kvslim.formats.loader import load_model
from kvslim.kernels import tiled_gemm
from kvslim.quantization import QuantLinear


def quantize(capsys, *argv):
    rc = main(["quantize", *map(str, argv), "--quiet"])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("flags,message", [
    (["--method", "rtn", "--bits", "3", "--group-size", "32"], "--bits must be 4 or 8, got 3"),
    (["--method", "rtn", "--group-size", "48"],
     "--group-size 48 does not divide the input features of the model's linear layers "
     "(hidden_size = 64)"),
    (["--method", "gptq", "--group-size", "32"], "--method gptq needs calibration text: --calib FILE"),
    (["--method", "awq", "--group-size", "32"],
     "--method awq needs calibration text: --calib FILE"),
    (["--method", "hqq"], "unknown --method 'hqq'; choose one of rtn, gptq, awq, w8a8, int8"),
    (["--method", "w8a8", "--smooth-alpha", "1.5", "--calib", "x.txt"],
     "--smooth-alpha must lie in [0, 1], got 1.5"),
    (["--method", "w8a8", "--smooth-alpha", "-0.1", "--calib", "x.txt"],
     "--smooth-alpha must lie in [0, 1], got -0.1"),
    (["--method", "w8a8", "--smooth-alpha", "0.5"],
     "--smooth-alpha needs calibration text: --calib FILE"),
    (["--method", "w8a8", "--calib", "x.txt"],
     "--method w8a8 uses --calib only for SmoothQuant: add --smooth-alpha"),
    (["--method", "rtn", "--smooth-alpha", "0.5", "--group-size", "32"],
     "--smooth-alpha is SmoothQuant's, for --method w8a8, not rtn"),
    (["--method", "awq", "--act-order", "--group-size", "32", "--calib", "x.txt"],
     "--act-order orders GPTQ's columns; --method awq has none to order"),
    (["--method", "rtn", "--act-order", "--group-size", "32"], "--act-order orders GPTQ's columns"),
])
def test_bad_options_are_one_line(hf_checkpoints, tmp_path, capsys, flags, message):
    rc, out = quantize(capsys, hf_checkpoints["gqa"], tmp_path / "q", *flags)
    assert rc == 2
    assert message in out.err and len(out.err.strip().splitlines()) == 1
    assert not (tmp_path / "q").exists()


def test_quantized_source_is_refused(hf_checkpoints, tmp_path, capsys):
    first = tmp_path / "q"
    assert quantize(capsys, hf_checkpoints["gqa"], first, "--method", "rtn",
                    "--group-size", "32")[0] == 0
    rc, out = quantize(capsys, first, tmp_path / "qq", "--method", "rtn")
    assert rc == 2 and len(out.err.strip().splitlines()) == 1
    assert "is already quantized (quantization_config quant_method 'gptq')" in out.err


@pytest.mark.parametrize("flags", [["--method", "rtn", "--bits", "4", "--no-sym"],
                                   ["--method", "gptq", "--bits", "8", "--act-order"],
                                   ["--method", "awq", "--bits", "4"],
                                   ["--method", "awq", "--bits", "4", "--no-awq-clip"]])
def test_writes_a_gptq_checkpoint(hf_checkpoints, calib_file, tmp_path, capsys, flags):
    dst = tmp_path / "q"
    rc, out = quantize(capsys, hf_checkpoints["gqa"], dst, "--group-size", "32", "--calib",
                       calib_file, "--calib-samples", "4", "--seq-len", "32", *flags)
    assert rc == 0, out.err
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    bits = 4 if "4" in flags else 8
    assert qc["quant_method"] == "gptq" and qc["bits"] == bits and qc["group_size"] == 32
    assert qc["sym"] == ("--no-sym" not in flags)
    assert qc["desc_act"] == ("--act-order" in flags)
    assert qc["checkpoint_format"] == ("gptq_v2" if "--no-sym" in flags else "gptq")
    assert (dst / "tokenizer.json").is_file()
    model = load_model(dst, dtype=torch.float32)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert not isinstance(model.lm_head, QuantLinear)


def test_int8_is_one_symmetric_scale_per_output_channel(hf_checkpoints, tmp_path, capsys):
    rc, out = quantize(capsys, hf_checkpoints["gqa"], tmp_path / "q8", "--method", "int8")
    assert rc == 0, out.err
    config = json.loads((tmp_path / "q8" / "config.json").read_text())["quantization_config"]
    assert (config["bits"], config["group_size"], config["sym"]) == (8, -1, True)
    model = load_model(tmp_path / "q8", dtype=torch.float32)
    model.prepare_for_inference()
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    kernel = "group_forward" if tiled_gemm.available() else "int8_linear"  # kvslim's, or torch's
    assert layers and all(m.kernel.func.__name__ == kernel for m in layers)


@pytest.mark.parametrize("flags", [[], ["--smooth-alpha", "0.5"]])
def test_w8a8_writes_compressed_tensors_and_runs_the_integer_kernel(hf_checkpoints, calib_file,
                                                                    tmp_path, capsys, flags):
    calib = ["--calib", calib_file, "--calib-samples", "4", "--seq-len", "32"] if flags else []
    rc, out = quantize(capsys, hf_checkpoints["gqa"], tmp_path / "w", "--method", "w8a8",
                       *calib, *flags)
    assert rc == 0, out.err
    assert "w8a8" in out.out and ("SmoothQuant alpha 0.5" in out.out) == bool(flags)
    config = json.loads((tmp_path / "w" / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "int-quantized")
    model = load_model(tmp_path / "w", dtype=torch.float32)
    model.prepare_for_inference()
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * len(model.model.layers)
    assert all(m.kernel.func.__name__ == "w8a8_linear" for m in layers)
