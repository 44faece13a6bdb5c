"""A whole model pruned layer by layer: the checkpoint holds exactly the pattern, loads in
transformers to the same logits as kvslim's, and with --bits in the engine; config.json records
the pruning; bad input gets a one-line error (CLI exit 2) before anything is written."""
import json
import re

import pytest
import torch

from kvslim.cli.main import main
from kvslim.formats.loader import load_model
from kvslim.surgery.prune.masks import SparsityTarget
from kvslim.surgery.prune.model import prune_model
from kvslim.quantization import QuantSpec

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_weights(model_dir):
    from safetensors.torch import load_file
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    return {k: v for k, v in weights.items()
            if k.endswith(".weight") and any(f".{n}." in k for n in LINEAR_NAMES)}


@pytest.mark.parametrize("method,target", [("magnitude", SparsityTarget(sparsity=0.5)),
                                           ("wanda", SparsityTarget(n=2, m=4)),
                                           ("sparsegpt", SparsityTarget(sparsity=0.3))])
def test_a_pruned_model_loads_in_transformers(hf_checkpoints, calib_file, tmp_path, method,
                                             target):
    from transformers import AutoModelForCausalLM
    src = hf_checkpoints["gqa"]
    dst = prune_model(src, tmp_path / "p", method, target, calib=calib_file, calib_samples=4,
                      seq_len=32, show_progress=False)
    for name, w in linear_weights(dst).items():
        zero = w == 0
        if target.structured:
            assert (zero.view(w.shape[0], -1, 4).sum(-1) >= 2).all(), name
        else:
            assert (zero.sum(1) >= int(w.shape[1] * 0.3)).all(), name
    assert json.loads((dst / "config.json").read_text())["kvslim_pruning"]["method"] == method
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(dst, torch_dtype=torch.float32)
    with torch.no_grad():
        ours = load_model(dst, dtype=torch.float32).logits(ids)
        theirs = hf(ids).logits
        dense = load_model(src, dtype=torch.float32).logits(ids)
    assert (ours - theirs).abs().max() < 1e-4
    assert not torch.allclose(ours, dense)


def test_pruned_and_quantized_weights_run_in_the_engine(hf_checkpoints, calib_file, tmp_path):
    from engine.engine_helpers import GREEDY, engine, run, tokens
    from kvslim.engine.sampling_params import SamplingParams
    src = hf_checkpoints["gqa"]
    spec = QuantSpec(4, 32, False, True, "gptq")
    dst = prune_model(src, tmp_path / "p", "sparsegpt", SparsityTarget(n=2, m=4), spec,
                      calib_file, calib_samples=4, seq_len=32, show_progress=False)
    assert "quantization_config" in json.loads((dst / "config.json").read_text())
    out = tokens(run(engine(dst), [[5, 6, 7, 8]], SamplingParams(max_tokens=8, **GREEDY)))
    assert len(out[0]) == 8


BAD = [(["--method", "magnitude", "--sparsity", "1.5"], r"--sparsity must lie in \(0, 1\)"),
       (["--method", "magnitude", "--pattern", "3:7"], "divisible by 7"),
       (["--method", "wanda", "--sparsity", "0.5"], "needs calibration text"),
       (["--method", "lottery", "--sparsity", "0.5"], "unknown --method 'lottery'"),
       (["--method", "magnitude"], "exactly one of --sparsity F and --pattern N:M"),
       (["--method", "magnitude", "--pattern", "2:4", "--bits", "4", "--group-size", "6"],
        "does not divide")]


@pytest.mark.parametrize("flags,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_refused_in_one_line(hf_checkpoints, tmp_path, capsys, flags, message):
    dst = tmp_path / "x"
    assert main(["prune", str(hf_checkpoints["gqa"]), str(dst), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
    assert not dst.exists()


def test_pruned_or_quantized_sources_are_refused(hf_checkpoints, tmp_path, capsys):
    src = str(hf_checkpoints["gqa"])
    args = ["--method", "magnitude", "--sparsity", "0.5", "--quiet"]
    assert main(["prune", src, str(tmp_path / "p"), *args]) == 0
    assert main(["quantize", src, str(tmp_path / "q"), "--method", "rtn", "--group-size", "32",
                 "--quiet"]) == 0
    capsys.readouterr()
    for source, message in [("p", "already pruned"), ("q", "already quantized")]:
        assert main(["prune", str(tmp_path / source), str(tmp_path / "y"), *args]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_mixture_of_experts_models_are_refused(hf_checkpoints, tmp_path, capsys):
    dst = tmp_path / "moe"
    assert main(["prune", str(hf_checkpoints["mixtral"]), str(dst), "--method", "magnitude",
                 "--sparsity", "0.5", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "mixture-of-experts" in err, err
    assert not dst.exists()


def test_compressed_tensors_format_from_the_cli(hf_checkpoints, tmp_path, capsys):
    """--format compressed-tensors: 2:4 weights stored sparse-24-bitmask (every decoder linear
    compressed), loaded dense; the output is recognised as pruned."""
    dst = tmp_path / "ct"
    args = ["--method", "magnitude", "--pattern", "2:4", "--quiet"]
    assert main(["prune", str(hf_checkpoints["gqa"]), str(dst), *args, "--format",
                 "compressed-tensors", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "compressed-tensors"
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["sparsity_config"]["format"] == "sparse-24-bitmask"
    assert cfg["kvslim_pruning"]["pattern"] == "2:4" and not linear_weights(dst)
    w = load_model(dst, dtype=torch.float32).model.layers[0].mlp.down_proj.weight
    assert ((w.view(-1, 4) == 0).sum(-1) >= 2).all()
    assert main(["prune", str(dst), str(tmp_path / "again"), *args]) == 2
    assert "already pruned" in capsys.readouterr().err
