"""Loading and saving HF directories, and the errors bad checkpoints give."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from checkpoints import VOCAB
from kvslim.errors import ConfigError, WeightsError
from kvslim.models.config import ModelConfig
from kvslim.formats.loader import load_model
from kvslim.formats.writer import save_model


def copy_checkpoint(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("variant,shards", [("gqa", 1), ("tied", 1), ("qwen2_bias", 3)])
def test_saved_model_loads_in_transformers_with_same_logits(hf_checkpoints, tmp_path, variant,
                                                            shards):
    model = load_model(hf_checkpoints[variant], dtype=torch.float32)
    total = sum(p.numel() * 4 for p in model.hf_state_dict().values())
    out = save_model(model.hf_state_dict(), model.config, tmp_path / "out",
                     max_shard_bytes=total // shards + 1)
    num_files = len(list(out.glob("*.safetensors")))
    assert (num_files >= shards) and (num_files > 1) == (shards > 1)
    assert (out / "model.safetensors.index.json").is_file() == (shards > 1)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        again = load_model(out, dtype=torch.float32).logits(ids)
        orig = model.logits(ids)
    assert torch.equal(again, orig)
    assert (ref - orig).abs().max() <= 1e-4
    assert ModelConfig.from_dir(out).to_hf_dict() == ModelConfig.from_dir(out).replace().to_hf_dict()


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_model(tmp_path / "nope")


def test_missing_weights(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["gqa"], tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors weights"):
        load_model(path)


def test_missing_one_weight(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["gqa"], tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="missing weight 'model.layers.1.mlp.up_proj.weight'"):
        load_model(path)


def test_unknown_architecture(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["gqa"], tmp_path)
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(path)


def test_heads_not_divisible(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["gqa"], tmp_path)
    edit_config(path, num_key_value_heads=3)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(8\) is not divisible by "
                                          r"num_key_value_heads \(3\)"):
        load_model(path)


def test_wrong_weight_shape(hf_checkpoints, tmp_path):
    path = copy_checkpoint(hf_checkpoints["gqa"], tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape "
                                           r"\[7, 64\], expected \[16, 64\]"):
        load_model(path)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(tmp_path)


def test_config_reads_legacy_rope_fields():
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4
    assert cfg.kv_bytes_per_token("float16") == 2 * 1 * 2 * 4 * 2


@pytest.mark.parametrize("tied,bias,checksum,squares", [
    (True, False, 2518682.967512, 167.43120156),
    (False, True, 2574068.956127, 168.651350197),
])
def test_init_model_draws_the_same_weights_as_the_unfused_layout(tied, bias, checksum, squares):
    """Values computed with the model of separate q/k/v and gate/up projections (commit
    686b849): normal draws per HF-named tensor in checkpoint order, so fusing changed nothing."""
    from kvslim.formats.loader import init_model
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32,
                         intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
                         qkv_bias=bias, o_bias=bias, mlp_bias=bias)
    state = init_model(config, seed=3).hf_state_dict()
    flat = torch.cat([t.double().flatten() for n, t in state.items()
                      if not (tied and n == "lm_head.weight")])
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    assert (flat * weights).sum().item() == pytest.approx(checksum, rel=1e-10)
    assert flat.square().sum().item() == pytest.approx(squares, rel=1e-10)
