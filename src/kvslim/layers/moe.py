"""A sparse mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE; DeepSeek's routers and
shared experts in layers/deepseek_moe.py): a router picks the top-k
of E gated MLPs per token, their outputs are summed weighted by the router probabilities,
renormalised over the chosen experts (Mixtral; Qwen3-MoE when `norm_topk_prob` is set).

Experts run batched: each expert that any token of the step chose runs once, on all of its
tokens gathered into one matrix (one GEMM per expert and projection), and the results are added
back in place — never a loop over tokens. Every expert stays resident, as in the checkpoint.

Which experts were chosen, and by which tokens, is read back to the host (`unique`, `where`):
a CUDA graph cannot record that, nor can a compiled CPU decode step (engine/cpu_compile.py)
leave those sizes open. While one is being captured or compiled, every expert runs on every
token instead, weighted by its routing weight, zero where it was not chosen (`_all_experts`): no host read, the same sum (adding a zero changes nothing), at E / k
times the arithmetic on the few tokens of a decode step, whose cost is reading the experts'
weights, which a batch of decodes mostly touches anyway."""
from __future__ import annotations

import torch
from torch import nn

from kvslim.layers.linear import Linear
from kvslim.layers.mlp import SwiGLUMLP


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 activation: str = "silu", norm_topk_prob: bool = True):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden, num_experts, bias=False)          # the router
        self.experts = nn.ModuleList(SwiGLUMLP(hidden, intermediate, activation=activation)
                                     for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.route(x)
        if torch.compiler.is_compiling() or (x.is_cuda
                                              and torch.cuda.is_current_stream_capturing()):
            return self._all_experts(x, weights, chosen).reshape(shape)
        return self._chosen_experts(x, weights, chosen).reshape(shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> each token's (weights, experts) [N, top_k]. As transformers: softmax
        in float32, top-k, (renormalised over the chosen experts). Other routers override it."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def _chosen_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                        ) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _all_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                     ) -> torch.Tensor:
        """Every expert on every token, in expert order as `_chosen_experts` adds them."""
        routing = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype,
                              device=x.device).scatter_(1, chosen, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += (expert(x) * routing[:, e, None]).to(out.dtype)
        return out
