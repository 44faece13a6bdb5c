"""DeepSeek's mixture of experts: `SparseMoE`'s routed experts (run the same way, layers/moe.py)
with DeepSeek's routers, and shared experts — `n_shared_experts` experts' width as one gated
MLP that every token runs — added to the routed output. Routing as transformers 5.23 computes
it, on float32 scores:

- V2 (`softmax`): softmax over the router logits; `greedy` takes the top-k experts,
  `group_limited_greedy` first keeps the `topk_group` best of `n_group` groups (a group scored by
  its best expert) and takes the top-k among their experts. The chosen probabilities are scaled
  by `routed_scaling_factor`, never renormalised (transformers 5.23's V2 reads no
  norm_topk_prob).
- V3 (`sigmoid`, noaux_tc): sigmoid scores; the experts are chosen on the scores plus
  `e_score_correction_bias` (a group scored by the sum of its best two, `topk_group` groups
  kept), weighted by the unbiased scores, renormalised under `norm_topk_prob`, scaled by
  `routed_scaling_factor`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvslim.layers.linear import LinearQuantization
from kvslim.layers.mlp import SwiGLUMLP
from kvslim.layers.moe import SparseMoE


class DeepseekMoE(SparseMoE):
    def __init__(self, hidden: int, moe, activation: str = "silu", shared_bias: bool = False,
                 quant: LinearQuantization | None = None):
        """moe: the model's `MoEConfig` (experts, widths and the router's fields)."""
        super().__init__(hidden, moe.expert_intermediate_size, moe.num_experts,
                         moe.num_experts_per_tok, activation, moe.norm_topk_prob)
        self.scoring, self.topk_method = moe.scoring, moe.topk_method
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.routed_scaling_factor = moe.routed_scaling_factor
        if moe.scoring == "sigmoid":
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))
        self.shared_experts = (
            SwiGLUMLP(hidden, moe.expert_intermediate_size * moe.num_shared_experts, shared_bias,
                      quant, activation) if moe.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        if self.scoring == "sigmoid":
            return self._noaux_tc(_row_sigmoid(logits))
        scores = logits.softmax(dim=-1)
        if self.topk_method == "group_limited_greedy":
            keep = self._group_mask(scores.view(len(x), self.n_group, -1).amax(dim=-1))
            scores = scores.masked_fill(~keep, 0.0)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, chosen

    def _noaux_tc(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        biased = scores + self.gate.e_score_correction_bias.float()
        group_scores = biased.view(len(scores), self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        biased = biased.masked_fill(~self._group_mask(group_scores), float("-inf"))
        # in expert order: an unsorted top-k's order may change with the number of rows, and
        # with it the order of the weights' sum below (batch invariance)
        chosen = torch.topk(biased, self.top_k, dim=-1, sorted=False)[1].sort(dim=-1).values
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, chosen

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[N, n_group] scores -> [N, experts] bool: the experts of each token's `topk_group`
        best groups."""
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        experts = len(self.experts) // self.n_group
        return keep.unsqueeze(-1).expand(-1, -1, experts).reshape(len(group_scores), -1)


def _row_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """sigmoid, each row's bits the same whatever the number of rows. torch's CPU loop takes
    two SIMD vectors at a time (16 floats on AVX2, 32 on AVX-512) and the rest in scalar code,
    whose exp rounds otherwise: a row of 8 experts alone is all scalar, among others mostly
    SIMD. Rows padded to a multiple of 64 take the SIMD path alone or batched."""
    width = logits.shape[-1]
    return F.pad(logits, (0, -width % 64)).sigmoid()[..., :width]


def layer_is_sparse(moe, layer_idx: int) -> bool:
    """Whether a decoder layer's MLP is the experts: every layer after the leading dense ones
    (transformers 5.23 reads no moe_layer_freq; config parsing refuses one other than 1)."""
    return moe is not None and layer_idx >= moe.first_dense_layers
