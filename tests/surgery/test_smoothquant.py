"""SmoothQuant: the scales follow the formula, folding them leaves the float model's output as it
was, and on activations with outlier channels smoothed W8A8 beats plain W8A8."""
import copy

import pytest
import torch

from kvslim.formats.loader import load_model
from kvslim.quantization.kernels import w8a8_linear
from kvslim.quantization.w8a8 import W8A8_SPEC
from kvslim.surgery.quantize.model import layer0_inputs, linear_inputs, quantize_layers
from kvslim.surgery.quantize.smoothquant import int8_per_channel, smooth_layer, smooth_scale

from test_awq import _layer_inputs, uneven, windows


def test_scale_is_the_papers_formula():
    w = torch.tensor([[1.0, -4.0, 0.5], [-2.0, 1.0, 0.25]])
    x_max = torch.tensor([8.0, 1.0, 16.0])
    s = smooth_scale(w, x_max, 0.5)
    assert torch.allclose(s, torch.tensor([8 / 2, 1 / 4, 16 / 0.5]).sqrt())
    assert torch.allclose(smooth_scale(w, x_max, 1.0), x_max)
    assert torch.allclose(smooth_scale(w, x_max, 0.0), 1 / torch.tensor([2.0, 4.0, 0.5]))


def test_int8_per_channel_is_symmetric_with_max_over_127():
    w = torch.tensor([[0.5, -1.27, 0.0], [2.54, 1.0, -0.02]])
    q = int8_per_channel(w)
    assert torch.allclose(q.scales, torch.tensor([[0.01, 0.02]]))
    assert torch.equal(q.q - 128, torch.tensor([[50, -127, 0], [127, 50, -1]]))
    assert (q.dequantize() - w).abs().max() <= 0.01


@pytest.mark.parametrize("variant", ["mha", "gqa", "qwen2_bias"])
@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_folding_leaves_the_float_model_unchanged(hf_checkpoints, calib_file, variant, alpha):
    src = hf_checkpoints[variant]
    model = load_model(src, dtype=torch.float32)
    ids = windows(src, calib_file)
    with torch.no_grad():
        ref = model.logits(ids)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for layer, inputs in zip(model.model.layers, _layer_inputs(model, ids)):
            smooth_layer(layer, linear_inputs(layer, inputs), alpha)
        got = model.logits(ids)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert {"model.layers.0.input_layernorm.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.post_attention_layernorm.weight"} <= changed
    # o is smoothed (into v) only where every query head has its own v head.
    assert ("model.layers.0.self_attn.o_proj.weight" in changed) == (variant == "mha")
    assert (got - ref).abs().max().item() < 1e-5


def test_smoothing_beats_plain_w8a8_on_outlier_channels(hf_checkpoints, calib_file):
    """Layer 0's q/k/v output, run by the W8A8 kernel, on a model whose norms are uneven (GQA:
    the v rows are not rescaled for o, so the output is comparable as it is)."""
    src = hf_checkpoints["gqa"]
    float_model = uneven(load_model(src, dtype=torch.float32), spread=2.5)
    ids = windows(src, calib_file)
    inputs = layer0_inputs(float_model, ids, 4)
    x = linear_inputs(float_model.model.layers[0], inputs)["self_attn.qkv_proj"]
    errors = {}
    with torch.no_grad():
        ref = float_model.model.layers[0].self_attn.qkv_proj(x)
        for alpha in (None, 0.5):
            model = copy.deepcopy(float_model)
            results = quantize_layers(model, W8A8_SPEC, ids if alpha else None, method="w8a8",
                                      smooth_alpha=alpha, show_progress=False)
            layer = model.model.layers[0]
            q = results["model.layers.0.self_attn.qkv_proj"]
            x_in = x / (float_model.model.layers[0].input_layernorm.weight
                        / layer.input_layernorm.weight)
            out = w8a8_linear(x_in, (q.q - 128).to(torch.int8), q.scales[0])
            errors[alpha] = ((out - ref).norm() / ref.norm()).item()
    assert errors[0.5] < 0.7 * errors[None], errors
