"""The engine's fused projections compute the same function as the HF-layout model."""
import pytest
import torch

from checkpoints import VOCAB
from kvslim.layers.fused import FusedAttention, FusedMLP, fuse_for_inference
from kvslim.formats.loader import load_model


@pytest.mark.parametrize("variant", ["gqa", "mqa", "qwen2_bias", "head_dim", "llama3_rope"])
def test_fused_model_matches(hf_checkpoints, variant):
    ids = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        ref = load_model(hf_checkpoints[variant]).logits(ids)
        fused = fuse_for_inference(load_model(hf_checkpoints[variant]))
        assert all(isinstance(l.self_attn, FusedAttention) and isinstance(l.mlp, FusedMLP)
                   for l in fused.model.layers)
        torch.testing.assert_close(fused.logits(ids), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gqa", "qwen2_bias", "tied"])
def test_packed_cpu_linears_match(hf_checkpoints, variant):
    from kvslim.layers.cpu_linear import PackedLinear, pack_linears_for_cpu
    ids = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        ref = load_model(hf_checkpoints[variant]).logits(ids)
        model = fuse_for_inference(load_model(hf_checkpoints[variant]))
        if not pack_linears_for_cpu(model):
            pytest.skip("oneDNN linear not available in this torch build")
        assert isinstance(model.lm_head, PackedLinear)
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)
        torch.testing.assert_close(model.logits(ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gemv_copy", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_packed_linear_every_row_count(bias, rows, gemv_copy):
    """One row takes the GEMV path (when the layer keeps that copy), more rows the packed
    kernel: both compute nn.Linear."""
    from kvslim.layers.cpu_linear import PackedLinear, packed_linear_available
    if not packed_linear_available():
        pytest.skip("oneDNN linear not available in this torch build")
    linear = torch.nn.Linear(40, 24, bias=bias)
    x = torch.randn(rows, 40)
    with torch.no_grad():
        packed = PackedLinear(linear, gemv_copy)
        assert (packed.weight_in_out is not None) == gemv_copy
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x[None]), linear(x)[None],
                                   atol=1e-5, rtol=1e-5)
