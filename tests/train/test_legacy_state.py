"""A trainer_state.pt saved before q/k/v and gate/up were fused resumes exactly: after one more
step with the same gradients, the unfused optimizer and the fused one hold the same weights."""
import pytest
import torch

from kvslim.errors import KvslimError
from kvslim.formats.loader import init_model
from kvslim.models.config import ModelConfig
from kvslim.train.legacy_state import fuse_optimizer_state, is_unfused_state


def tiny(tied: bool, bias: bool):
    config = ModelConfig.from_hf_dict(dict(
        architectures=["Qwen2ForCausalLM" if bias else "LlamaForCausalLM"], vocab_size=48,
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=64))
    return init_model(config, seed=1)


def adamw(tensors):
    """As make_optimizer builds it: weight decay on matrices only."""
    return torch.optim.AdamW([{"params": [t for t in tensors if t.dim() >= 2], "weight_decay": 0.1},
                              {"params": [t for t in tensors if t.dim() < 2], "weight_decay": 0.0}],
                             lr=1e-2)


def set_fused_grads(model, grads: dict) -> None:
    """Each parameter's gradient, written shard by shard through the checkpoint-name views."""
    params = list(model.parameters())
    weights = [p.data for p in params]
    for p in params:
        p.data = torch.zeros_like(p)
    views = model.hf_state_dict()
    with torch.no_grad():
        for name, grad in grads.items():
            views[name].copy_(grad)
    for p, w in zip(params, weights):
        p.grad, p.data = p.data, w


def test_unfused_optimizer_state_resumes_exactly():
    for tied in (True, False):
        for bias in (False, True):
            model = tiny(tied, bias)
            views = model.hf_state_dict()
            names = [n for n in views if not (tied and n == "lm_head.weight")]
            # The run as the unfused model trained it: one tensor per checkpoint matrix.
            old = {n: views[n].detach().clone().requires_grad_() for n in names}
            old_opt = adamw([old[n] for n in names])
            g = torch.Generator().manual_seed(0)
            for _ in range(2):
                for n in names:
                    old[n].grad = torch.randn(old[n].shape, generator=g)
                old_opt.step()
            with torch.no_grad():                     # the saved weights, in the fused model
                for n in names:
                    views[n].copy_(old[n])
            new_opt = adamw(list(model.parameters()))
            saved = old_opt.state_dict()
            assert is_unfused_state(saved, new_opt)
            new_opt.load_state_dict(fuse_optimizer_state(saved, model, new_opt))
            grads = {n: torch.randn(old[n].shape, generator=g) for n in names}
            for n in names:
                old[n].grad = grads[n]
            old_opt.step()
            set_fused_grads(model, grads)
            new_opt.step()
            after = model.hf_state_dict()
            for n in names:
                torch.testing.assert_close(after[n], old[n].detach(), rtol=0, atol=1e-6)


def test_a_state_of_another_model_is_refused():
    model, other = tiny(True, False), tiny(False, True)
    saved = adamw([t.detach().clone() for t in other.hf_state_dict().values()]).state_dict()
    with pytest.raises(KvslimError, match="does not match"):
        fuse_optimizer_state(saved, model, adamw(list(model.parameters())))
