"""RTN and GPTQ on single matrices, and a whole model quantized layer by layer (RTN, GPTQ, AWQ)."""
import pytest
import torch

from kvslim.formats.loader import load_model
from kvslim.quantization import QuantSpec
from kvslim.surgery.quantize.gptq import Hessian, gptq_quantize
from kvslim.surgery.quantize.model import quantize_layers, quantize_model
from kvslim.surgery.quantize.rtn import rtn_quantize
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.train.data import eval_windows, tokenize_file


def calibration(n=2048, d=256, seed=0):
    """Correlated inputs with uneven channel scales (as activations have) and a weight."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) / d ** 0.5 + torch.eye(d)
    x = (torch.randn(n, d, generator=g) @ mix) * torch.rand(d, generator=g).mul(3).exp()
    return x, torch.randn(96, d, generator=g) * 0.05


def error(x, w, q):
    return ((x @ w.t() - x @ q.t()).norm() / (x @ w.t()).norm()).item()


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_reconstructs_better_than_rtn(bits, group, sym):
    x, w = calibration()
    h = Hessian(x.shape[1])
    for chunk in x.split(500):
        h.add(chunk)
    assert torch.allclose(h.matrix, 2 * x.t() @ x / len(x), rtol=1e-4, atol=1e-3)
    rtn = rtn_quantize(w, bits, group, sym)
    gptq = gptq_quantize(w, h.matrix, bits, group, sym)
    act = gptq_quantize(w, h.matrix, bits, group, sym, act_order=True)
    e_rtn, e_gptq, e_act = (error(x, w, r.dequantize()) for r in (rtn, gptq, act))
    assert e_gptq < 0.8 * e_rtn, (e_rtn, e_gptq)
    assert e_act < 0.8 * e_rtn, (e_rtn, e_act)


def test_codes_and_groups_are_in_range_and_act_order_groups_by_importance():
    x, w = calibration(d=128)
    h = 2 * x.t() @ x / len(x)
    result = gptq_quantize(w, h, 4, 32, sym=False, act_order=True)
    assert result.q.min() >= 0 and result.q.max() <= 15
    assert result.zeros.min() >= 0 and result.zeros.max() <= 15
    assert result.scales.shape == (4, 96) and torch.equal(result.scales, result.scales.half().float())
    order = torch.argsort(h.diagonal(), descending=True)
    assert torch.equal(result.g_idx[order].long(), torch.arange(128) // 32)


def test_rtn_is_within_one_step():
    """Half a step of rounding, plus at a group's edge up to half a step of the zero point's."""
    _, w = calibration()
    for sym in (True, False):
        r = rtn_quantize(w, 4, 64, sym)
        step = r.scales[r.g_idx.long()].t()
        assert ((w - r.dequantize()).abs() <= step + 1e-6).all()


@pytest.mark.parametrize("method,act_order",
                         [("rtn", False), ("gptq", True), ("awq", False)])
def test_written_model_is_the_quantized_one(hf_checkpoints, calib_file, tmp_path, method,
                                            act_order):
    """The checkpoint loads to exactly what quantize_layers left in memory, and stays close to
    the original model."""
    src = hf_checkpoints["qwen2_bias"]
    spec = QuantSpec(8, 32, act_order, True, "gptq")
    dst = quantize_model(src, tmp_path / "q", method, spec, calib_file, calib_samples=4,
                         seq_len=32, show_progress=False)
    in_memory = load_model(src, dtype=torch.float32)
    windows = None
    if method != "rtn":
        tokens = tokenize_file(calib_file, Tokenizer.from_dir(src), show_progress=False)
        windows = eval_windows(tokens, 32, 4)[:, :32]
    quantize_layers(in_memory, spec, windows, show_progress=False, method=method)
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = load_model(src, dtype=torch.float32).logits(ids)
        expected = in_memory.logits(ids)
        got = load_model(dst, dtype=torch.float32).logits(ids)
    assert (got - expected).abs().max().item() < 1e-4
    assert ((got - ref).norm() / ref.norm()).item() < 0.05


@pytest.mark.parametrize("variant", ["qwen3", "gemma3", "nonuniform"])
def test_other_families_and_per_layer_kv_heads_quantize(hf_checkpoints, calib_file, tmp_path,
                                                        variant):
    """GPTQ on Qwen3 (q/k norms), Gemma 3 and a model whose layers differ in KV heads: the
    checkpoint loads, each layer keeps its shapes, and the logits stay near the float ones."""
    from kvslim.errors import KvslimError
    from kvslim.surgery.convert import convert_to_gqa
    src = (convert_to_gqa(hf_checkpoints["mha8"], tmp_path / "nu", [4, 1], "mean",
                          show_progress=False)
           if variant == "nonuniform" else hf_checkpoints[variant])
    spec = QuantSpec(8, 32, False, True, "gptq")
    dst = quantize_model(src, tmp_path / "q", "gptq", spec, calib_file, calib_samples=4,
                         seq_len=32, show_progress=False)
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = load_model(src).logits(ids), load_model(dst).logits(ids)
    assert load_model(dst).config.kv_heads_per_layer == load_model(src).config.kv_heads_per_layer
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    if variant == "gemma3":
        with pytest.raises(KvslimError, match="does not support Gemma 3's norms"):
            quantize_model(src, tmp_path / "a", "awq", QuantSpec(4, 32, False, True, "gptq"),
                           calib_file, calib_samples=4, seq_len=32, show_progress=False)
