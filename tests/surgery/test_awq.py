"""AWQ: the scale and clipping searches on one matrix, the folds on a whole float model, and a
layer with uneven activation scales quantized better than by RTN."""
import copy

import pytest
import torch

from kvslim.formats.loader import load_model
from kvslim.quantization import QuantSpec
from kvslim.surgery.quantize.awq import clip_weight, fold_layer, search_scale
from kvslim.surgery.quantize.model import layer0_inputs, linear_inputs, quantize_layers
from kvslim.surgery.quantize.rtn import rtn_quantize
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.train.data import eval_windows, tokenize_file

from test_quantize import calibration, error


def uneven(model, spread=2.5, seed=0):
    """Spread the norms' weights over two orders of magnitude, so a few input channels of
    q/k/v and gate/up carry most of the activation, as in trained models."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.mul_(torch.randn(norm.weight.shape, generator=g).mul(spread).exp())
    return model


def windows(src, calib_file):
    tokens = tokenize_file(calib_file, Tokenizer.from_dir(src), show_progress=False)
    return eval_windows(tokens, 32, 8)[:, :32]


def test_search_scale_beats_rtn_and_reports_its_errors():
    x, w = calibration()
    s, e_awq, e_rtn = search_scale(w, x, 4, 32)
    assert e_rtn == pytest.approx(error(x, w, rtn_quantize(w, 4, 32).dequantize()), rel=1e-4)
    assert e_awq == pytest.approx(error(x, w, rtn_quantize(w * s, 4, 32).dequantize() / s),
                                  rel=1e-4)
    assert e_awq < 0.95 * e_rtn, (e_rtn, e_awq)
    flat, e_flat, e_flat_rtn = search_scale(w, torch.randn(512, 256), 4, 32)
    assert e_flat <= e_flat_rtn


@pytest.mark.parametrize("sym", [True, False])
def test_clipping_shrinks_ranges_and_lowers_the_error(sym):
    x, w = calibration()
    clipped = clip_weight(w, x, 4, 32, sym)
    assert (clipped.abs() <= w.abs()).all() and (clipped.sign() * w.sign() >= 0).all()
    assert not torch.equal(clipped, w)
    e_rtn = error(x, w, rtn_quantize(w, 4, 32, sym).dequantize())
    e_clip = error(x, w, rtn_quantize(clipped, 4, 32, sym).dequantize())
    assert e_clip < e_rtn, (e_rtn, e_clip)


@pytest.mark.parametrize("variant", ["mha", "gqa", "qwen2_bias"])
@pytest.mark.parametrize("dtype,spread", [(torch.float32, 0.0), (torch.float64, 2.5)])
def test_folding_leaves_the_float_model_unchanged(hf_checkpoints, calib_file, variant, dtype,
                                                  spread):
    """Exact up to rounding: float32 on the checkpoint as it is; float64 where the norms span
    orders of magnitude (float32 rounding there reaches 1e-4 of logits near 5)."""
    src = hf_checkpoints[variant]
    model = uneven(load_model(src, dtype=dtype), spread)
    ids = windows(src, calib_file)
    with torch.no_grad():
        ref = model.logits(ids)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for layer, inputs in zip(model.model.layers, _layer_inputs(model, ids)):
            fold_layer(layer, linear_inputs(layer, inputs), 4, 32, True, dtype)
        got = model.logits(ids)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert "model.layers.0.input_layernorm.weight" in changed
    assert "model.layers.1.mlp.down_proj.weight" in changed
    assert (got - ref).abs().max().item() < 1e-5


def _layer_inputs(model, ids):
    """Each decoder layer's positional arguments on the float model, batch by batch."""
    inputs = layer0_inputs(model, ids, 4)
    for layer in model.model.layers:
        yield inputs
        inputs = [(layer(*args), *args[1:]) for args in inputs]


def test_awq_beats_rtn_on_a_layer_with_uneven_activations(hf_checkpoints, calib_file):
    """Layer 0 (the first quantized, on float inputs) of a model whose norms are uneven."""
    src = hf_checkpoints["mha"]
    float_model = uneven(load_model(src, dtype=torch.float32))
    ids = windows(src, calib_file)
    spec = QuantSpec(4, 32, False, True, "gptq")
    inputs = layer0_inputs(float_model, ids, 4)
    errors = {}
    with torch.no_grad():
        ref = torch.cat([float_model.model.layers[0](*args) for args in inputs])
        for method in ("rtn", "awq"):
            model = copy.deepcopy(float_model)
            quantize_layers(model, spec, ids, show_progress=False, method=method)
            out = torch.cat([model.model.layers[0](*args) for args in inputs])
            errors[method] = ((out - ref).norm() / ref.norm()).item()
    assert errors["awq"] < 0.8 * errors["rtn"], errors
