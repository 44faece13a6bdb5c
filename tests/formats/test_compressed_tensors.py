"""compressed-tensors "pack-quantized" checkpoints (llm-compressor's W4A16 / W8A16): the packing,
and checkpoints packed here by hand from compressed-tensors' rules (pack_to_int32: signed values
offset by 2^(bits-1), lowest bits first; zero points packed along the output dim), not by
kvslim's code, that load to the weights they encode, compute what the float model with those
weights computes, and generate."""
import numpy as np
import pytest
import torch

from kvslim.errors import ConfigError, WeightsError
from kvslim.formats.compressed_tensors import pack_to_int32, unpack_from_int32
from kvslim.formats.loader import load_model
from kvslim.quantization import QuantSpec
from quantized_checkpoints import (greedy_matches_float_model, layer_weights, max_logit_error,
                                   rewrite, write_quantized_checkpoint)


def hand_pack(signed: np.ndarray, bits: int, axis: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32: value + 2^(bits-1), then value j of each run of
    32 / bits along `axis` in bits [j * bits, (j + 1) * bits) of its word."""
    v = np.moveaxis(signed.astype(np.int64) + 2 ** (bits - 1), axis, 1).astype(np.uint32)
    per = 32 // bits
    words = np.zeros((v.shape[0], v.shape[1] // per), dtype=np.uint32)
    for j in range(per):
        words |= v[:, j::per] << np.uint32(bits * j)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, 1, axis)).view(np.int32))


def ct_layer(bits, group, sym, actorder=False):
    def make(out, n, gen):
        half = 2 ** (bits - 1)
        groups = 1 if group == -1 else n // group
        if actorder:
            g_idx = torch.empty(n, dtype=torch.int64)
            g_idx[torch.randperm(n, generator=gen)] = torch.arange(n) // group
        else:
            g_idx = torch.arange(n) // (n if group == -1 else group)
        q = torch.randint(-half, half, (out, n), generator=gen)
        zp = (torch.zeros(out, groups, dtype=torch.int64) if sym
              else torch.randint(-half, half, (out, groups), generator=gen))
        scale = ((torch.rand(out, groups, generator=gen) + 0.5) * (0.2 / half)).bfloat16()
        weight = (q - zp[:, g_idx]).float() * scale[:, g_idx].float()
        stored = {"weight_packed": hand_pack(q.numpy(), bits, 1), "weight_scale": scale,
                  "weight_shape": torch.tensor([out, n])}
        if not sym:
            stored["weight_zero_point"] = hand_pack(zp.numpy(), bits, 0)
        if actorder:
            stored["weight_g_idx"] = g_idx.to(torch.int32)
        return stored, weight
    return make


def ct_config(bits=4, group=32, sym=True, actorder=None, fmt="pack-quantized", **weights):
    w = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
         "strategy": "channel" if group == -1 else "group",
         "group_size": None if group == -1 else group, "actorder": actorder,
         "observer": "minmax", "block_structure": None, **weights}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "global_compression_ratio": None,
            "kv_cache_scheme": None, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                          "input_activations": None,
                                          "output_activations": None}}}


def write_ct(src, dst, bits=4, group=32, sym=True, actorder=False):
    cfg = ct_config(bits, group, sym, "group" if actorder else None)
    return write_quantized_checkpoint(src, dst, cfg, ct_layer(bits, group, sym, actorder))


def test_packing_follows_the_documented_example():
    # pack_to_int32's docstring: 8 bits, [1, 2] (+ padding) -> [129, 130, 0, 0] -> 33409
    assert pack_to_int32(torch.tensor([[1, 2, -128, -128]]), 8, dim=1).item() == 33409


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_round_trips_and_matches_the_hand_packer(bits, dim):
    half = 2 ** (bits - 1)
    values = torch.randint(-half, half, (32, 48), generator=torch.Generator().manual_seed(bits))
    packed = pack_to_int32(values, bits, dim)
    assert packed.dtype == torch.int32 and packed.shape[dim] == values.shape[dim] * bits // 32
    assert torch.equal(packed, hand_pack(values.numpy(), bits, dim))
    assert torch.equal(unpack_from_int32(packed, bits, dim), values)


# (variant, bits, group, symmetric, actorder "group"): W4A16 group-wise symmetric, W4A16
# asymmetric with act-order groups, W8A16 per channel on tied embeddings.
CASES = [("gqa", 4, 32, True, False), ("qwen2_bias", 4, 32, False, True),
         ("tied", 8, -1, True, False)]


@pytest.mark.parametrize("variant,bits,group,sym,actorder", CASES)
def test_hand_packed_checkpoint_loads_to_its_weights(hf_checkpoints, tmp_path, variant, bits,
                                                     group, sym, actorder):
    path, _, expected = write_ct(hf_checkpoints[variant], tmp_path / "q", bits, group, sym,
                                 actorder)
    model = load_model(path, dtype=torch.float32)
    spec = model.config.quantization
    assert (spec.bits, spec.group_size, spec.sym, spec.desc_act) == (bits, group, sym, actorder)
    assert len(expected) == 14
    for name, got, ref in layer_weights(model, expected):
        assert torch.equal(got, ref), name


@pytest.mark.parametrize("variant,bits,group,sym,actorder", CASES)
def test_logits_match_the_dequantized_float_model(hf_checkpoints, tmp_path, variant, bits,
                                                  group, sym, actorder):
    path, float_dir, _ = write_ct(hf_checkpoints[variant], tmp_path / "q", bits, group, sym,
                                  actorder)
    assert max_logit_error(path, float_dir) < 1e-4


def test_greedy_generation_through_the_engine(hf_checkpoints, tmp_path):
    """W8A16 runs the int8 kernel in the engine."""
    path, float_dir, _ = write_ct(hf_checkpoints["gqa"], tmp_path / "q", 8, -1, True)
    greedy_matches_float_model(path, float_dir, [9, 33, 120, 4, 61, 250])


def scheme(cfg):
    return cfg["config_groups"]["group_0"]


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(format="marlin-24"),
     "quantization_config format 'marlin-24' is not supported"),
    (lambda c: c.update(format="float-quantized"), "format 'float-quantized'"),
    (lambda c: c.update(format="naive-quantized"), "format 'naive-quantized'"),
    (lambda c: scheme(c).update(input_activations={"num_bits": 8, "type": "int"}),
     "config_groups.group_0.input_activations is set"),
    (lambda c: scheme(c)["weights"].update(type="float"),
     "config_groups.group_0.weights.type 'float' is not supported"),
    (lambda c: scheme(c)["weights"].update(num_bits=2),
     "config_groups.group_0.weights.num_bits 2 is not supported"),
    (lambda c: scheme(c)["weights"].update(strategy="tensor", group_size=None),
     "weights.strategy 'tensor' is not supported"),
    (lambda c: scheme(c)["weights"].update(group_size=None),
     "weights.group_size None must be a positive integer"),
    (lambda c: scheme(c)["weights"].update(actorder="sideways"), "weights.actorder 'sideways'"),
    (lambda c: c.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme is set"),
    (lambda c: c["config_groups"].update(
        group_1={**scheme(c), "weights": {**scheme(c)["weights"], "num_bits": 8}}),
     "config_groups group_0 and group_1 quantize weights differently"),
    (lambda c: c.pop("config_groups"), "config_groups must be"),
])
def test_bad_configs_are_one_line_errors_naming_the_field(edit, message):
    cfg = ct_config()
    edit(cfg)
    with pytest.raises(ConfigError, match=message) as err:
        QuantSpec.from_hf(cfg)
    assert "\n" not in str(err.value)


def test_per_group_format_and_inferred_strategy():
    cfg = ct_config(fmt="mixed-precision", group=128, strategy=None)
    scheme(cfg)["format"] = "pack-quantized"
    spec = QuantSpec.from_hf(cfg)
    assert (spec.bits, spec.group_size, spec.sym, spec.method) == (4, 128, True,
                                                                   "compressed-tensors")


def test_checkpoint_problems_are_named(hf_checkpoints, tmp_path):
    path, _, _ = write_ct(hf_checkpoints["gqa"], tmp_path / "q", 4, 32, False)
    name = "model.layers.0.mlp.up_proj"
    rewrite(path, lambda t: {k: v for k, v in t.items() if k != f"{name}.weight_zero_point"})
    with pytest.raises(WeightsError, match=f"missing weight '{name}.weight_zero_point'"):
        load_model(path, dtype=torch.float32)
    rewrite(path, lambda t: {**t, f"{name}.weight_zero_point": torch.zeros(16, 2),
                             f"{name}.weight_shape": torch.tensor([128, 64])})
    with pytest.raises(WeightsError, match=f"'{name}.weight_zero_point' is float32, "
                                           "expected int32"):
        load_model(path, dtype=torch.float32)
    rewrite(path, lambda t: {**t, f"{name}.weight_zero_point": torch.zeros(16, 2,
                                                                           dtype=torch.int32),
                             f"{name}.weight_shape": torch.tensor([64, 128])})
    with pytest.raises(WeightsError, match=rf"{name}.weight_shape is \[64, 128\], "
                                           r"expected \[128, 64\]"):
        load_model(path, dtype=torch.float32)


def test_a_quantized_lm_head_is_refused(hf_checkpoints, tmp_path):
    """kvslim keeps lm_head float: a checkpoint whose ignore list did not name it is refused."""
    path, _, _ = write_ct(hf_checkpoints["gqa"], tmp_path / "q")
    stored, _ = ct_layer(4, 32, True)(320, 64, torch.Generator().manual_seed(0))
    rewrite(path, lambda t: {**{k: v for k, v in t.items() if k != "lm_head.weight"},
                             **{f"lm_head.{k}": v for k, v in stored.items()}})
    with pytest.raises(WeightsError, match="'lm_head' is stored quantized"):
        load_model(path, dtype=torch.float32)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("actorder", [None, "group"])
def test_the_stored_tensors_follow_the_scheme(sym, actorder):
    from kvslim.formats.compressed_tensors import leaves, stored_shapes
    spec = QuantSpec.from_hf(ct_config(4, 32, sym, actorder))
    shapes = stored_shapes(spec, 128, 64)
    assert set(leaves(spec)) == set(shapes)
    assert shapes["weight_packed"][0] == (128, 8) and shapes["weight_scale"][0] == (128, 2)
    assert ("weight_zero_point" in shapes) == (not sym)
    assert ("weight_g_idx" in shapes) == (actorder == "group")


def test_int_quantized_with_4_bit_weights_names_the_field():
    """int-quantized is read for W8A8 only: another scheme in it is refused by field."""
    from kvslim.quantization.w8a8 import W8A8_SPEC
    cfg = W8A8_SPEC.to_hf()
    cfg["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(ConfigError, match="group_0.weights.num_bits is 4; kvslim reads 8"):
        QuantSpec.from_hf(cfg)
