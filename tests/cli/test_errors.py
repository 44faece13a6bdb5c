"""Bad checkpoints on the command line: one line naming the problem, exit 2, no traceback."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file


def broken(hf_checkpoints, tmp_path, how):
    path = tmp_path / "model"
    shutil.copytree(hf_checkpoints["gqa"], path)
    cfg = json.loads((path / "config.json").read_text())
    if how == "no-config":
        (path / "config.json").unlink()
    elif how == "no-weights":
        (path / "model.safetensors").unlink()
    elif how == "architecture":
        cfg["architectures"] = ["FalconForCausalLM"]
    elif how == "heads":
        cfg["num_key_value_heads"] = 3
    elif how == "shape":
        tensors = load_file(path / "model.safetensors")
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 64)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if how in ("architecture", "heads"):
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("how,message", [
    ("no-config", "no config.json in"),
    ("no-weights", "no *.safetensors weights in"),
    ("architecture", "unsupported architecture 'FalconForCausalLM'"),
    ("heads", "num_attention_heads (8) is not divisible by num_key_value_heads (3)"),
    ("shape", "'model.layers.0.mlp.up_proj.weight' has shape [5, 64], expected [128, 64]"),
])
def test_bad_checkpoint_is_one_line(hf_checkpoints, tmp_path, how, message):
    path = broken(hf_checkpoints, tmp_path, how)
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "generate", "--model",
                        str(path), "--prompt", "x", "--raw", "--max-tokens", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert message in r.stderr
    errors = [line for line in r.stderr.strip().splitlines() if "kvslim: loading" not in line]
    assert "Traceback" not in r.stderr and len(errors) == 1
