"""The engine's fused projections compute the same function as the HF-layout model."""
import pytest
import torch

from checkpoints import VOCAB
from kvslim.model.fused import FusedAttention, FusedMLP, fuse_for_inference
from kvslim.model.loader import load_model


@pytest.mark.parametrize("variant", ["gqa", "mqa", "qwen2_bias", "head_dim", "llama3_rope"])
def test_fused_model_matches(hf_checkpoints, variant):
    ids = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        ref = load_model(hf_checkpoints[variant]).logits(ids)
        fused = fuse_for_inference(load_model(hf_checkpoints[variant]))
        assert all(isinstance(l.self_attn, FusedAttention) and isinstance(l.mlp, FusedMLP)
                   for l in fused.model.layers)
        torch.testing.assert_close(fused.logits(ids), ref, atol=1e-5, rtol=1e-5)
