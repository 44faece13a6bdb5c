"""kvslim convert: exactness, pooling arithmetic, group mapping, transformers loading, errors."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from checkpoints import VARIANTS, VOCAB
from kvslim.errors import ConfigError, KvslimError
from kvslim.models.config import ModelConfig
from kvslim.formats.loader import load_model
from kvslim.surgery.convert import convert_to_gqa, pool_heads

IDS = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(3))


def logits(path):
    with torch.no_grad():
        return load_model(path, dtype=torch.float32).logits(IDS)


@pytest.mark.parametrize("method", ["mean", "first", "random"])
def test_converting_to_the_same_heads_is_exact(hf_checkpoints, tmp_path, method):
    src = hf_checkpoints["mha8"]
    dst = convert_to_gqa(src, tmp_path / "out", 8, method, show_progress=False)
    assert ModelConfig.from_dir(dst).num_key_value_heads == 8
    if method == "random":
        assert not torch.equal(logits(src), logits(dst))      # fresh heads: a real change
    else:
        assert torch.equal(logits(src), logits(dst))


def test_mean_pooling_is_the_average_of_the_group_rows(hf_checkpoints, tmp_path):
    src = hf_checkpoints["mha8"]                               # 8 heads of head_dim 8
    dst = convert_to_gqa(src, tmp_path / "out", 2, "mean", show_progress=False)
    before, after = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    for proj in ("k_proj", "v_proj"):
        w = before[f"model.layers.1.self_attn.{proj}.weight"]
        by_hand = torch.stack([(w[0:8] + w[8:16] + w[16:24] + w[24:32]) / 4,
                               (w[32:40] + w[40:48] + w[48:56] + w[56:64]) / 4]).reshape(16, -1)
        torch.testing.assert_close(after[f"model.layers.1.self_attn.{proj}.weight"], by_hand)
    assert torch.equal(after["model.layers.1.self_attn.q_proj.weight"],
                       before["model.layers.1.self_attn.q_proj.weight"])


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_group_g_takes_query_heads_g_h_over_k(kv_heads):
    heads, d = 8, 3
    w = torch.arange(heads, dtype=torch.float32).repeat_interleave(d)[:, None].expand(-1, 5)
    first = pool_heads(w, heads, kv_heads, "first").reshape(kv_heads, d, 5)[:, 0, 0]
    mean = pool_heads(w, heads, kv_heads, "mean").reshape(kv_heads, d, 5)[:, 0, 0]
    size = heads // kv_heads
    assert first.tolist() == [g * size for g in range(kv_heads)]
    assert mean.tolist() == [g * size + (size - 1) / 2 for g in range(kv_heads)]


def test_biases_are_pooled_too(hf_checkpoints, tmp_path):
    src = hf_checkpoints["qwen2_bias"]                         # 4 heads over 2 KV heads
    dst = convert_to_gqa(src, tmp_path / "out", 1, "mean", show_progress=False)
    before, after = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    b = before["model.layers.0.self_attn.k_proj.bias"]
    torch.testing.assert_close(after["model.layers.0.self_attn.k_proj.bias"],
                               (b[:16] + b[16:]) / 2)


@pytest.mark.parametrize("method", ["mean", "align"])
def test_transformers_loads_the_result_with_identical_logits(hf_checkpoints, tmp_path,
                                                             calib_file, method):
    dst = convert_to_gqa(hf_checkpoints["mha8"], tmp_path / "out", 2, method, calib=calib_file,
                         calib_samples=4, calib_seq_len=32, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads == 2
    with torch.no_grad():
        assert (hf(IDS).logits - logits(dst)).abs().max() <= 1e-4


@pytest.mark.parametrize("variant", ["qwen3", "phi3", "phi3_longrope", "mixtral", "qwen3_moe",
                                     "gemma3"])
def test_other_families_convert_and_transformers_loads_them(hf_checkpoints, tmp_path, variant):
    """Qwen3's q/k norms; Phi-3's fused qkv_proj / gate_up_proj, split at load, fused again
    when written, and its LongRoPE written back as transformers reads it; Mixtral's experts under their checkpoint names; Qwen3-MoE's expert fields;
    Gemma 3's layers."""
    dst = convert_to_gqa(hf_checkpoints[variant], tmp_path / "out", 1, "mean",
                         show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    arch = VARIANTS[variant]["arch"]
    assert hf.config.model_type in (arch, arch + "_text")
    assert hf.config.num_key_value_heads == 1
    with torch.no_grad():
        assert (hf(IDS).logits - logits(dst)).abs().max() <= 1e-4
    names = set(load_file(dst / "model.safetensors"))
    assert ("model.layers.0.self_attn.qkv_proj.weight" in names) == (arch == "phi3")


def test_align_refuses_qk_norms(hf_checkpoints, tmp_path, calib_file):
    with pytest.raises(KvslimError, match="q/k norms do not commute"):
        convert_to_gqa(hf_checkpoints["qwen3"], tmp_path / "a", 1, "align", calib=calib_file)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("kv_heads,message", [
    (3, "does not divide the model's 8 KV heads"),
    (16, "more than the model's 8 KV heads"),
    (0, "must be a positive integer"),
    (-2, "must be a positive integer"),
])
def test_bad_kv_heads(hf_checkpoints, tmp_path, kv_heads, message):
    with pytest.raises(KvslimError, match=message):
        convert_to_gqa(hf_checkpoints["mha8"], tmp_path / "out", kv_heads, "mean")
    assert not (tmp_path / "out").exists()


def test_align_needs_calibration_and_unknown_methods_fail(hf_checkpoints, tmp_path):
    with pytest.raises(KvslimError, match="--calib"):
        convert_to_gqa(hf_checkpoints["mha8"], tmp_path / "out", 2, "align")
    with pytest.raises(KvslimError, match="unknown --method 'median'"):
        convert_to_gqa(hf_checkpoints["mha8"], tmp_path / "out", 2, "median")


def test_empty_calibration_file(hf_checkpoints, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(KvslimError, match="empty"):
        convert_to_gqa(hf_checkpoints["mha8"], tmp_path / "out", 2, "align", calib=empty)


def test_not_a_llama_family_model(hf_checkpoints, tmp_path):
    src = tmp_path / "gpt2"
    shutil.copytree(hf_checkpoints["mha8"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture"):
        convert_to_gqa(src, tmp_path / "out", 2, "mean")


def test_cli_error_is_one_line(hf_checkpoints, tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "convert",
                        str(hf_checkpoints["mha8"]), str(tmp_path / "o"), "--kv-heads", "3"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "does not divide" in r.stderr


@pytest.mark.parametrize("kv_heads,tp,expect", [
    (2, 2, None),                                   # split: one KV head per rank
    (1, 2, "must be replicated"),                   # MQA at 2 ranks: each stores the head
    (2, 4, "must be replicated"),
    (4, 3, "cannot run"),                           # 3 does not divide 8 query heads
])
def test_convert_warns_when_tensor_parallelism_would_replicate(hf_checkpoints, tmp_path, capsys,
                                                                kv_heads, tp, expect):
    from kvslim.cli.main import main
    assert main(["convert", str(hf_checkpoints["mha8"]), str(tmp_path / "o"), "--kv-heads",
                 str(kv_heads), "--tensor-parallel-size", str(tp), "--json"]) == 0
    r = capsys.readouterr()
    warning = json.loads(r.out)["tensor_parallel_warning"]
    if expect is None:
        assert warning is None and "warning" not in r.err
    else:
        assert expect in warning and expect in r.err
