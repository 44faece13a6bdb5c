"""AWQ GEMM checkpoints (AutoAWQ's layout): the nibble order, and checkpoints packed here by hand
from AutoAWQ's rules (gemm.py's `from_linear` loop, not kvslim's code) that load to the weights
they encode, compute what the float model with those weights computes, and generate."""
import json

import pytest
import torch

from kvslim.errors import ConfigError, WeightsError
from kvslim.formats.awq import AWQ_REVERSE_ORDER, pack_awq, unpack_awq
from kvslim.formats.loader import load_model
from kvslim.quantization import QuantSpec
from quantized_checkpoints import (ORDER, awq_config, greedy_matches_float_model, hand_pack_awq,
                                   layer_weights, max_logit_error, rewrite, write_awq)

def test_nibble_order_is_autoawqs():
    values = torch.arange(8).unsqueeze(0)
    # nibble k holds output ORDER[k]: 0, 2, 4, 6, 1, 3, 5, 7 from the lowest bits up
    assert pack_awq(values).item() == 0x75316420
    assert AWQ_REVERSE_ORDER == (0, 4, 1, 5, 2, 6, 3, 7)     # AutoAWQ's packing_utils.py


def test_packing_round_trips_and_matches_the_hand_packer():
    values = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_awq(values)
    assert packed.dtype == torch.int32 and packed.shape == (24, 8)
    assert torch.equal(packed, hand_pack_awq(values.numpy()))
    assert torch.equal(unpack_awq(packed), values)


@pytest.mark.parametrize("variant,group", [("qwen2_bias", 32), ("tied", 64)])
def test_hand_packed_checkpoint_loads_to_its_weights(hf_checkpoints, tmp_path, variant, group):
    path, _, expected = write_awq(hf_checkpoints[variant], tmp_path / "q", group)
    model = load_model(path, dtype=torch.float32)
    assert len(expected) == 14
    for name, got, ref in layer_weights(model, expected):
        assert torch.equal(got, ref), name


def test_logits_match_the_dequantized_float_model(hf_checkpoints, tmp_path):
    path, float_dir, _ = write_awq(hf_checkpoints["gqa"], tmp_path / "q")
    assert max_logit_error(path, float_dir) < 1e-4


def test_greedy_generation_through_the_engine(hf_checkpoints, tmp_path):
    """The engine runs the int4 kernel on the converted layers."""
    path, float_dir, _ = write_awq(hf_checkpoints["gqa"], tmp_path / "q")
    greedy_matches_float_model(path, float_dir, [5, 17, 42, 99, 7])


def test_zero_point_false_reads_the_stored_zeros(hf_checkpoints, tmp_path):
    """vLLM's awq.py reads qzeros whatever zero_point says; so does kvslim."""
    path, _, expected = write_awq(hf_checkpoints["gqa"], tmp_path / "q", zero_point=False)
    model = load_model(path, dtype=torch.float32)
    assert model.config.quantization.sym
    for name, got, ref in layer_weights(model, expected):
        assert torch.equal(got, ref), name


@pytest.mark.parametrize("change,message", [
    ({"version": "gemv"}, "quantization_config version 'gemv' is not supported"),
    ({"version": "GEMV_FAST"}, "version 'GEMV_FAST'"),
    ({"bits": 8}, "quantization_config bits 8 is not supported for quant_method 'awq'"),
    ({"group_size": 0}, "quantization_config group_size 0 must be"),
    ({"zero_point": "yes"}, "quantization_config zero_point 'yes'"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert 'lm_head'"),
])
def test_bad_configs_are_one_line_errors_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message) as err:
        QuantSpec.from_hf(awq_config(**change))
    assert "\n" not in str(err.value)


def test_autoawq_key_names_are_read():
    spec = QuantSpec.from_hf({"quant_method": "awq", "w_bit": 4, "q_group_size": 128,
                              "zero_point": True, "version": "GEMM"})
    assert (spec.bits, spec.group_size, spec.method) == (4, 128, "awq")


def test_checkpoint_problems_are_named(hf_checkpoints, tmp_path):
    path, _, _ = write_awq(hf_checkpoints["gqa"], tmp_path / "q")
    name = "model.layers.1.mlp.down_proj"
    rewrite(path, lambda t: {k: v for k, v in t.items() if k != f"{name}.qzeros"})
    with pytest.raises(WeightsError, match=f"missing weight '{name}.qzeros'"):
        load_model(path, dtype=torch.float32)
    rewrite(path, lambda t: {**t, f"{name}.qzeros": t[f"{name}.scales"].clone()})
    with pytest.raises(WeightsError, match=rf"'{name}.qzeros' has shape \[4, 64\], "
                                           r"expected \[4, 8\]"):
        load_model(path, dtype=torch.float32)


def test_a_layer_left_unquantized_is_refused(hf_checkpoints, tmp_path):
    """modules_to_not_convert keeps a layer float; kvslim quantizes every decoder linear."""
    path, float_dir, _ = write_awq(hf_checkpoints["gqa"], tmp_path / "q")
    name = "model.layers.0.self_attn.o_proj"
    floats = load_model(float_dir, dtype=torch.float32).hf_state_dict()
    rewrite(path, lambda t: {**{k: v for k, v in t.items() if not k.startswith(name + ".")},
                             f"{name}.weight": floats[f"{name}.weight"].contiguous()})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["o_proj"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=f"'{name}.weight' is stored unquantized"):
        load_model(path, dtype=torch.float32)


def test_a_layers_tensors_may_sit_in_different_shards(hf_checkpoints, tmp_path):
    """Sharding splits by tensor: every `scales` here is in the second file, after the rest."""
    from safetensors.torch import load_file, save_file
    path, _, expected = write_awq(hf_checkpoints["gqa"], tmp_path / "q")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items()
                                                  if not k.endswith(".scales")},
             "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items()
                                                  if k.endswith(".scales")}}
    for fname, part in files.items():
        save_file(part, path / fname, metadata={"format": "pt"})
    index = {"weight_map": {k: fname for fname, part in files.items() for k in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(path, dtype=torch.float32)
    for name, got, ref in layer_weights(model, expected):
        assert torch.equal(got, ref), name
