"""The fused projections (q/k/v in one GEMM, gate/up in another) and the packed CPU kernel
compute the same function as the unfused HF-layout math."""
import pytest
import torch
import torch.nn.functional as F

from checkpoints import VOCAB
from kvslim.attention import DenseAttention
from kvslim.formats.loader import load_model
from kvslim.layers.linear import Linear, MergedLinear, QKVLinear
from kvslim.layers.rope import apply_rope
from kvslim.models.causal_lm import default_positions


def unfused_logits(model, ids):
    """The model's function computed from its HF-named tensors, one projection at a time."""
    cfg, w = model.config, model.hf_state_dict()
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def linear(x, name):
        return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    attn = DenseAttention(ids.shape[-1], ids.device, None, cfg.sliding_window)
    x = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary.cos_sin(default_positions(ids, None), x.dtype)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        a = layer.input_layernorm(x)
        q = apply_rope(linear(a, p + "self_attn.q_proj").view(*ids.shape, h, d), cos, sin)
        k = apply_rope(linear(a, p + "self_attn.k_proj").view(*ids.shape, kv, d), cos, sin)
        v = linear(a, p + "self_attn.v_proj").view(*ids.shape, kv, d)
        out = attn.attend(i, q, k, v, d ** -0.5).reshape(*ids.shape, h * d)
        x = x + linear(out, p + "self_attn.o_proj")
        m = layer.post_attention_layernorm(x)
        x = x + linear(F.silu(linear(m, p + "mlp.gate_proj")) * linear(m, p + "mlp.up_proj"),
                       p + "mlp.down_proj")
    return F.linear(model.model.norm(x), w["lm_head.weight"])


@pytest.mark.parametrize("variant", ["gqa", "mqa", "qwen2_bias", "head_dim", "llama3_rope"])
def test_fused_model_matches(hf_checkpoints, variant):
    ids = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        fused = load_model(hf_checkpoints[variant])
        ref = unfused_logits(fused, ids)
        assert all(isinstance(l.self_attn.qkv_proj, QKVLinear)
                   and isinstance(l.mlp.gate_up_proj, MergedLinear) for l in fused.model.layers)
        torch.testing.assert_close(fused.logits(ids), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gqa", "qwen2_bias", "tied"])
def test_packed_cpu_linears_match(hf_checkpoints, variant):
    ids = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        ref = load_model(hf_checkpoints[variant]).logits(ids)
        model = load_model(hf_checkpoints[variant])
        if not model.prepare_for_inference():
            pytest.skip("oneDNN linear not available in this torch build")
        assert model.lm_head.kernel is not None
        assert model.model.layers[0].self_attn.qkv_proj.kernel is not None
        torch.testing.assert_close(model.logits(ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gemv_copy", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_packed_linear_every_row_count(bias, rows, gemv_copy):
    """kvslim's tiled kernel where it builds; else one row takes the GEMV path (when the layer
    keeps that copy), more rows the packed kernel: each computes nn.Linear."""
    from kvslim.kernels import tiled_gemm
    from kvslim.layers.cpu_linear import TiledCpuKernel, packed_linear_available
    if not packed_linear_available():
        pytest.skip("oneDNN linear not available in this torch build")
    linear = torch.nn.Linear(40, 24, bias=bias)
    x = torch.randn(rows, 40)
    with torch.no_grad():
        packed = Linear(40, 24, bias=bias)
        packed.load_state_dict(linear.state_dict())
        packed.prepare_for_inference(gemv_copy, release_weight=True)
        if tiled_gemm.available():
            assert isinstance(packed.kernel, TiledCpuKernel)
        else:
            assert (packed.kernel.weight_in_out is not None) == gemv_copy
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x[None]), linear(x)[None],
                                   atol=1e-5, rtol=1e-5)
