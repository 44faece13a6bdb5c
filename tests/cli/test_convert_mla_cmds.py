"""`kvslim convert --to-mla` on the command line, then `kvslim uptrain` of the result (plain, and
distilled from the source); bad input: one line, exit 2, no DST."""
import json
import math

import pytest
import torch

from kvslim.cli.main import main
from kvslim.formats.loader import load_model
from kvslim.models.config import ModelConfig


def test_convert_then_uptrain_plain_and_distilled(hf_checkpoints, calib_file, tmp_path, capsys):
    src, mla = hf_checkpoints["gqa"], tmp_path / "mla"
    assert main(["convert", str(src), str(mla), "--to-mla", "--kv-lora-rank", "12",
                 "--rope-dim", "6", "--method", "transmla", "--calib", str(calib_file),
                 "--calib-samples", "4", "--calib-seq-len", "32", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (record["method"], record["kv_lora_rank"], record["qk_rope_head_dim"]) == \
        ("transmla", 12, 6)
    assert record["kv_bytes_per_token"] == 2 * (12 + 6) * 4 < record["source_kv_bytes_per_token"]
    before = load_model(mla).model.layers[0].self_attn.kv_b_proj.weight
    for name, extra in (("plain", []), ("distilled", ["--teacher", str(src),
                                                      "--match-attention"])):
        out = tmp_path / name
        assert main(["uptrain", str(mla), "--data", str(calib_file), "--out", str(out),
                     "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-3",
                     "--device", "cpu", "--quiet", "--json", *extra]) == 0
        metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert metrics["step"] == 3 and math.isfinite(metrics["loss"])
        assert ModelConfig.from_dir(out).mla.kv_lora_rank == 12
        trained = load_model(out)
        assert not torch.equal(trained.model.layers[0].self_attn.kv_b_proj.weight, before)


@pytest.mark.parametrize("variant,argv,message", [
    ("gqa", ["--kv-lora-rank", "40"], "--kv-lora-rank 40 must be in 1..28"),
    ("gqa", [], "--to-mla needs --kv-lora-rank R"),
    ("gqa", ["--kv-lora-rank", "8", "--rope-dim", "12"], "--rope-dim 12 must be even and in 2..8"),
    ("qwen3", ["--kv-lora-rank", "8"], "Qwen3ForCausalLM is not supported"),
])
def test_bad_input_is_one_line_and_writes_nothing(hf_checkpoints, tmp_path, capsys, variant,
                                                  argv, message):
    dst = tmp_path / "mla"
    assert main(["convert", str(hf_checkpoints[variant]), str(dst), "--to-mla", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not dst.exists()
