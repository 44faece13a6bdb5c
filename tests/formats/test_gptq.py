"""The GPTQ checkpoint layout: packing round trips, and a checkpoint packed here by hand from the
layout's rules (not by kvslim's writer) loads to the weights it encodes."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvslim.errors import WeightsError
from kvslim.formats.gptq import QuantizedWeight, pack_gptq, unpack_gptq
from kvslim.formats.loader import load_model
from kvslim.quantization import QuantSpec
from kvslim.quantization.gptq import pack_int32, unpack_int32
from quantized_checkpoints import max_logit_error, write_quantized_checkpoint

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def act_order_g_idx(n, group, gen):
    perm = torch.randperm(n, generator=gen)
    g_idx = torch.empty(n, dtype=torch.int32)
    g_idx[perm] = (torch.arange(n) // group).to(torch.int32)
    return g_idx


def random_weight(out, n, bits, group, act_order, gen, min_zero=0):
    groups = -(-n // group)
    top = 2 ** bits
    return QuantizedWeight(
        q=torch.randint(0, top, (out, n), generator=gen),
        zeros=torch.randint(min_zero, top, (groups, out), generator=gen),
        scales=(torch.rand(groups, out, generator=gen) + 0.5) * (0.2 / top),
        g_idx=(act_order_g_idx(n, group, gen) if act_order
               else (torch.arange(n) // group).to(torch.int32)))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_int32_packing_round_trips(bits, dim):
    values = torch.randint(0, 2 ** bits, (64, 48), generator=torch.Generator().manual_seed(bits))
    packed = pack_int32(values, bits, dim)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == values.shape[dim] * bits // 32
    assert torch.equal(unpack_int32(packed, bits, dim), values)


def test_first_value_sits_in_the_lowest_bits():
    packed = pack_int32(torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15]]), 4, 0)
    assert packed.item() == np.uint32(0xF7654321).astype(np.int32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_tensors_round_trip(bits, fmt, act_order):
    gen = torch.Generator().manual_seed(0)
    w = random_weight(48, 128, bits, 32, act_order, gen, min_zero=1 if fmt == "gptq" else 0)
    spec = QuantSpec(bits, 32, act_order, False, fmt)
    tensors = pack_gptq(w, spec)
    assert tensors["qweight"].shape == (128 * bits // 32, 48)
    assert tensors["qzeros"].shape == (4, 48 * bits // 32)
    assert tensors["scales"].dtype == torch.float16 and tensors["g_idx"].shape == (128,)
    back = unpack_gptq(tensors, spec)
    assert torch.equal(back.q, w.q) and torch.equal(back.zeros, w.zeros)
    assert torch.equal(back.g_idx, w.g_idx)
    assert torch.equal(back.scales, w.scales.half())


# ---- a checkpoint packed by hand -------------------------------------------------------------
def test_v1_zero_points_read_as_autogptq_reads_them():
    """v1 stores zero - 1 and AutoGPTQ reads `(stored & mask) + 1`: a stored 15 (4-bit) is a
    zero of 16, not 0. kvslim reads it the same way and refuses to write a zero of 0 as v1."""
    from kvslim.errors import ConfigError
    spec = QuantSpec(4, 32, False, False, "gptq")
    assert spec.zeros_from_stored(torch.tensor([0, 7, 15])).tolist() == [1, 8, 16]
    with pytest.raises(ConfigError, match="zero point of 0"):
        spec.zeros_to_stored(torch.tensor([0, 3]))


def hand_pack(values: np.ndarray, bits: int, axis: int) -> torch.Tensor:
    """32 // bits values per uint32 along `axis`, value k of a word at bits [k*bits, (k+1)*bits)."""
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    per = 32 // bits
    words = np.zeros((v.shape[0] // per, *v.shape[1:]), dtype=np.uint32)
    for i in range(v.shape[0]):
        words[i // per] |= v[i] << np.uint32(bits * (i % per))
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, 0, axis)).view(np.int32))


def hand_tensors(w: QuantizedWeight, bits: int, fmt: str) -> dict[str, torch.Tensor]:
    stored = w.zeros.numpy() - (1 if fmt == "gptq" else 0)       # v1 keeps zero - 1
    return {"qweight": hand_pack(w.q.t().numpy(), bits, 0),
            "qzeros": hand_pack(stored, bits, 1),
            "scales": w.scales.half(), "g_idx": w.g_idx.clone()}


def expected_weight(w: QuantizedWeight) -> torch.Tensor:
    out, n = w.q.shape
    ref = torch.empty(out, n)
    for i in range(n):
        g = int(w.g_idx[i])
        ref[:, i] = (w.q[:, i] - w.zeros[g]).float() * w.scales[g].half().float()
    return ref


def write_quantized(src, dst, bits, group, fmt, act_order):
    """dst: src's checkpoint with every decoder projection replaced by random GPTQ tensors;
    dst_float: the same model with those projections dequantized. Returns both paths and the
    expected weights by HF name."""
    def make_layer(out_f, in_f, gen):
        w = random_weight(out_f, in_f, bits, group, act_order, gen, min_zero=1)
        return hand_tensors(w, bits, fmt), expected_weight(w)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
              "sym": False, "checkpoint_format": fmt}
    return write_quantized_checkpoint(src, dst, config, make_layer, seed=bits)


CASES = [(4, 32, "gptq", False), (8, 32, "gptq_v2", True), (4, 64, "gptq_v2", True)]


@pytest.mark.parametrize("bits,group,fmt,act_order", CASES)
def test_hand_packed_checkpoint_loads_to_its_weights(hf_checkpoints, tmp_path, bits, group, fmt,
                                                     act_order):
    path, _, expected = write_quantized(hf_checkpoints["qwen2_bias"], tmp_path / "q", bits,
                                        group, fmt, act_order)
    model = load_model(path, dtype=torch.float32)
    mapping = model.packed_modules_mapping
    for name, ref in expected.items():
        prefix = name.rpartition(".")[0]
        parent, _, proj = prefix.rpartition(".")
        part, shard = mapping.get(proj, (proj, None))
        layer = model.get_submodule(f"{parent}.{part}")
        rows = layer._shard(shard)[1]
        assert torch.equal(layer.dequantized_weight()[rows], ref), name


@pytest.mark.parametrize("bits,group,fmt,act_order", CASES)
def test_quantized_logits_match_the_dequantized_float_model(hf_checkpoints, tmp_path, bits, group,
                                                            fmt, act_order):
    path, float_dir, _ = write_quantized(hf_checkpoints["gqa"], tmp_path / "q", bits, group, fmt,
                                         act_order)
    assert max_logit_error(path, float_dir) < 1e-4


def test_a_checkpoint_without_g_idx_loads_with_groups_in_order(hf_checkpoints, tmp_path):
    """Without act-order, writers may leave g_idx out: channel i is then in group i // size."""
    path, _, expected = write_quantized(hf_checkpoints["qwen2_bias"], tmp_path / "q", 4, 32,
                                        "gptq", False)
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith(".g_idx")},
              path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path, dtype=torch.float32)
    for name, ref in expected.items():
        prefix = name.rpartition(".")[0]
        parent, _, proj = prefix.rpartition(".")
        part, shard = model.packed_modules_mapping.get(proj, (proj, None))
        layer = model.get_submodule(f"{parent}.{part}")
        assert torch.equal(layer.dequantized_weight()[layer._shard(shard)[1]], ref), name


def test_an_act_order_checkpoint_without_g_idx_is_refused(hf_checkpoints, tmp_path):
    path, _, _ = write_quantized(hf_checkpoints["qwen2_bias"], tmp_path / "q", 4, 32, "gptq",
                                 True)
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith(".g_idx")},
              path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"missing weight .*g_idx"):
        load_model(path, dtype=torch.float32)
