"""The sparse MoE block: each chosen expert runs once per step on all of its tokens, and the
result equals routing every token on its own."""
import torch

from kvslim.layers.mlp import SwiGLUMLP
from kvslim.layers.moe import SparseMoE


def test_experts_run_batched_and_match_token_by_token():
    torch.manual_seed(0)
    moe = SparseMoE(16, 32, num_experts=4, top_k=2)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 17, 16)
    calls = []
    hooks = [e.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
             for e in moe.experts]
    with torch.no_grad():
        out = moe(x)
    for h in hooks:
        h.remove()
    assert len(calls) <= 4 and sum(calls) == 3 * 17 * 2          # each token in 2 experts
    with torch.no_grad():
        flat = x.reshape(-1, 16)
        ref = []
        for token in flat:
            probs = torch.softmax(moe.gate(token), -1)
            w, idx = torch.topk(probs, 2)
            ref.append(sum(wi / w.sum() * moe.experts[int(i)](token[None])[0]
                           for wi, i in zip(w, idx)))
    torch.testing.assert_close(out.reshape(-1, 16), torch.stack(ref), atol=1e-5, rtol=1e-5)
    assert all(isinstance(e, SwiGLUMLP) for e in moe.experts)


def six_experts_without_renormalising() -> tuple[SparseMoE, torch.Tensor]:
    """A random 6-expert top-2 block (norm_topk_prob off) and 9 tokens for it."""
    torch.manual_seed(1)
    moe = SparseMoE(16, 32, num_experts=6, top_k=2, norm_topk_prob=False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe, torch.randn(9, 16)


def test_without_norm_topk_prob_the_router_probabilities_weigh_as_they_are():
    """Qwen3-MoE's flag off: the chosen experts' softmax probabilities, not rescaled to 1."""
    moe, x = six_experts_without_renormalising()
    with torch.no_grad():
        out = moe(x)
        ref = []
        for token in x:
            w, idx = torch.topk(torch.softmax(moe.gate(token), -1), 2)
            ref.append(sum(wi * moe.experts[int(i)](token[None])[0] for wi, i in zip(w, idx)))
    torch.testing.assert_close(out, torch.stack(ref), atol=1e-5, rtol=1e-5)


def test_the_graph_capturable_path_equals_the_chosen_experts_path():
    """While a CUDA graph is captured every expert runs on every token, weighted by its routing
    weight (zero where not chosen): no host read, and the same sum."""
    moe, x = six_experts_without_renormalising()
    with torch.no_grad():
        weights, chosen = torch.topk(torch.softmax(moe.gate(x), -1), 2, dim=-1)
        sparse = moe._chosen_experts(x, weights, chosen)
        dense = moe._all_experts(x, weights, chosen)
    assert (dense - sparse).abs().max() < 1e-6
    assert sparse.abs().max() > 0.1
