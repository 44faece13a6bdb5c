"""Per-layer KV head counts in config.json (`num_key_value_heads_per_layer`): parsing, the KV
formula, validation, what transformers does with it, and GGUF's per-layer array."""
import json

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import VOCAB
from kvslim.cli.main import main
from kvslim.errors import ConfigError
from kvslim.formats.gguf.exporter import export_gguf
from kvslim.formats.gguf.importer import import_gguf
from kvslim.formats.loader import load_model
from kvslim.models.config import LAYER_KV_HEADS_KEY, ModelConfig
from kvslim.surgery.convert import convert_to_gqa

IDS = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(3))
BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8}


def test_per_layer_heads_price_the_cache_layer_by_layer():
    config = ModelConfig.from_hf_dict({**BASE, LAYER_KV_HEADS_KEY: [4, 1, 2]})
    assert config.kv_heads_per_layer == (4, 1, 2) and config.num_key_value_heads == 4
    assert config.kv_elements_per_token() == 2 * (4 + 1 + 2) * 8
    assert config.kv_scales_per_token() == 2 * 7
    assert config.kv_elements_per_token(8) == 2 * 3 * 8 * 8           # the MHA equivalent
    assert config.attention_kind == "GQA (per layer)"
    again = ModelConfig.from_hf_dict(config.to_hf_dict())
    assert again.kv_heads_per_layer == (4, 1, 2) and again.num_key_value_heads == 4
    assert again.to_hf_dict()[LAYER_KV_HEADS_KEY] == [4, 1, 2]


def test_equal_counts_are_a_plain_config():
    config = ModelConfig.from_hf_dict({**BASE, LAYER_KV_HEADS_KEY: [2, 2, 2]})
    assert config.layer_kv_heads is None and config.num_key_value_heads == 2
    assert LAYER_KV_HEADS_KEY not in config.to_hf_dict()
    assert config.to_hf_dict()["num_key_value_heads"] == 2


@pytest.mark.parametrize("heads,message", [
    ([4, 1], "has 2 entries for 3 layers"),
    ([4, 3, 1], "must be a positive divisor of num_attention_heads"),
    ([4, 0, 1], "must be a positive divisor"),
    ("4,1,1", "must be a list of integers"),
])
def test_bad_per_layer_heads(heads, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**BASE, LAYER_KV_HEADS_KEY: heads})


@pytest.fixture(scope="module")
def nonuniform(hf_checkpoints, tmp_path_factory):
    return convert_to_gqa(hf_checkpoints["mha8"], tmp_path_factory.mktemp("nu") / "m", [2, 1],
                          "mean", show_progress=False)


def test_transformers_refuses_a_nonuniform_checkpoint(nonuniform, tmp_path):
    """Its Llama classes build every layer with num_key_value_heads: the narrower layer's k/v
    weights do not fit, and loading fails loudly instead of running something else."""
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(nonuniform, dtype=torch.float32)


def test_info_and_memory_show_the_per_layer_counts(nonuniform, capsys):
    assert main(["info", str(nonuniform), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_heads_per_layer"] == [2, 1]
    assert info["kv_bytes_per_token"] == 2 * 3 * 8 * 4                # float32, 3 heads in all
    assert main(["info", str(nonuniform)]) == 0
    assert "KV heads / layer  2 1" in capsys.readouterr().out
    assert main(["memory", str(nonuniform), "--context", "100"]) == 0
    assert "KV heads per layer 2 1" in capsys.readouterr().out


def test_gguf_round_trip_keeps_the_per_layer_array(nonuniform, tmp_path):
    path = export_gguf(nonuniform, tmp_path / "nu.gguf", "f32", show_progress=False)
    field = gguf.GGUFReader(path).fields["llama.attention.head_count_kv"]
    assert [int(field.parts[i][0]) for i in field.data] == [2, 1]
    again = import_gguf(path, tmp_path / "back", show_progress=False)
    assert ModelConfig.from_dir(again).kv_heads_per_layer == (2, 1)
    with torch.no_grad():
        assert torch.equal(load_model(again).logits(IDS), load_model(nonuniform).logits(IDS))
