"""The compressed-tensors int-quantized (W8A8) layout: what `kvslim quantize --method w8a8`
writes reloads bit for bit, and a checkpoint built here from the published rules (not with
kvslim's writer) loads and computes the W8A8 product."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvslim.errors import WeightsError
from kvslim.formats.loader import load_model
from kvslim.quantization.w8a8 import W8A8_SPEC, W8A8Linear
from kvslim.surgery.quantize.model import quantize_model

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def written(hf_checkpoints, tmp_path_factory):
    return quantize_model(hf_checkpoints["gqa"], tmp_path_factory.mktemp("w8a8") / "gqa",
                          "w8a8", W8A8_SPEC, show_progress=False)


def test_written_checkpoint_reloads_bit_exactly(written, hf_checkpoints):
    stored = load_file(str(written / "model.safetensors"))
    cfg = json.loads((written / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    name = "model.layers.1.self_attn.k_proj"
    assert stored[f"{name}.weight"].dtype == torch.int8
    assert stored[f"{name}.weight_scale"].shape == (stored[f"{name}.weight"].shape[0], 1)
    assert f"{name}.weight_zero_point" not in stored and "lm_head.weight_scale" not in stored
    model = load_model(written, dtype=torch.float32)
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, W8A8Linear)
    views = model.hf_state_dict()
    for key, tensor in stored.items():
        assert views[key].dtype == tensor.dtype and torch.equal(views[key], tensor), key
    # The weights are the source's, rounded per output row to max|w| / 127.
    src = load_file(str(hf_checkpoints["gqa"] / "model.safetensors"))
    w = src[f"{name}.weight"].float()
    deq = stored[f"{name}.weight"].float() * stored[f"{name}.weight_scale"]
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(stored[f"{name}.weight"].abs().amax(dim=1), torch.full((w.shape[0],), 127,
                                                                              dtype=torch.int8))


def hand_built(src, dst, scale_dtype=torch.bfloat16):
    """llm-compressor's W8A8 int8 output by its rules: every decoder Linear as int8 `weight`
    and `weight_scale` [out, 1] in the model dtype, lm_head left out, config as published."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in PROJ:
            scale = (t.float().abs().amax(dim=1, keepdim=True) / 127).to(scale_dtype)
            tensors[name] = torch.round(t.float() / scale.float()).clamp(-128, 127).to(torch.int8)
            tensors[f"{module}.weight_scale"] = scale
        else:
            tensors[name] = t
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    args = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
            "actorder": None, "block_structure": None, "observer_kwargs": {}}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "global_compression_ratio": 1.24,
        "ignore": ["lm_head"], "kv_cache_scheme": None, "version": "0.9.1",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {**args, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**args, "strategy": "token", "dynamic": True,
                                  "observer": None}}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return tensors


def test_hand_built_checkpoint_loads_and_runs_w8a8(hf_checkpoints, tmp_path):
    tensors = hand_built(hf_checkpoints["gqa"], tmp_path / "ct")
    model = load_model(tmp_path / "ct", dtype=torch.float32)
    qkv = model.model.layers[0].self_attn.qkv_proj
    parts = [tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    scales = [tensors[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"]
    assert torch.equal(qkv.weight, torch.cat(parts))
    assert torch.equal(qkv.weight_scale, torch.cat(scales).float())
    x = torch.randn(7, qkv.in_features, generator=torch.Generator().manual_seed(0))
    sx = x.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(x / sx).clamp(-127, 127)
    want = (xq.double() @ qkv.weight.double().t()) * sx.double() * qkv.weight_scale.double().t()
    assert (qkv(x).double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    ids = torch.arange(12).view(1, 12)
    float_model = load_model(hf_checkpoints["gqa"], dtype=torch.float32)
    with torch.no_grad():
        got, ref = model.logits(ids), float_model.logits(ids)
    assert ((got - ref).norm() / ref.norm()).item() < 0.05


@pytest.mark.parametrize("zero", [0, 3])
def test_zero_points_must_be_zero_and_are_dropped(hf_checkpoints, tmp_path, zero):
    """Some compressed-tensors versions store weight_zero_point (int8 [out, 1]) for symmetric
    schemes too: all zeros load as if absent; anything else is refused by name."""
    tensors = hand_built(hf_checkpoints["gqa"], tmp_path / "ct")
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name.replace("weight_scale", "weight_zero_point")] = torch.zeros(
            tensors[name].shape, dtype=torch.int8)
    name = "model.layers.0.mlp.down_proj.weight_zero_point"
    tensors[name][1] = zero
    save_file(tensors, str(tmp_path / "ct" / "model.safetensors"), metadata={"format": "pt"})
    if zero:
        with pytest.raises(WeightsError, match=f"{name} is not all zeros, but the "
                                               "quantization_config says symmetric: true"):
            load_model(tmp_path / "ct", dtype=torch.float32)
        return
    model = load_model(tmp_path / "ct", dtype=torch.float32)
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(down.weight, tensors["model.layers.0.mlp.down_proj.weight"])


def test_weight_bytes_count_int8_codes_as_one_byte(written):
    from kvslim.formats.info import count_parameters, weight_bytes
    from kvslim.models.config import ModelConfig
    config = ModelConfig.from_dir(written)
    stored = load_file(str(written / "model.safetensors"))
    codes = sum(t.numel() for t in stored.values() if t.dtype == torch.int8)
    assert codes > 0
    assert count_parameters(written, config) == sum(t.numel() for t in stored.values())
    assert weight_bytes(written, config, 4) == codes + 4 * (count_parameters(written, config)
                                                            - codes)
    assert weight_bytes(written, config, 2) == codes + 2 * (count_parameters(written, config)
                                                            - codes)
