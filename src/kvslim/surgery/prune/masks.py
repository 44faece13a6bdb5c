"""Which weights a pruned layer keeps: the largest scores per output row, either a fraction of
the row (unstructured) or N of every M consecutive inputs (N:M, the pattern sparse kernels
read). Scores: magnitude |W|, or Wanda's |W_ij| * ||X_j||_2 (Sun et al. 2023: a weight matters
as much as the input it multiplies), the input norms from the calibration inputs' Hessian
diagonal, H_jj = 2/N sum x_j^2."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.errors import KvslimError


@dataclass(frozen=True)
class SparsityTarget:
    """What to prune: a fraction of each row, or N:M (keep n of every m inputs)."""
    sparsity: float | None = None
    n: int = 0
    m: int = 0

    @classmethod
    def parse(cls, sparsity: float | None, pattern: str | None) -> "SparsityTarget":
        if (sparsity is None) == (pattern is None):
            raise KvslimError("give exactly one of --sparsity F and --pattern N:M")
        if pattern is not None:
            try:
                n, m = (int(v) for v in pattern.split(":"))
            except ValueError:
                raise KvslimError(f"--pattern must be N:M (e.g. 2:4), got {pattern!r}") from None
            if not 0 < n < m:
                raise KvslimError(f"--pattern N:M needs 0 < N < M, got {pattern}")
            return cls(n=n, m=m)
        if not 0 < sparsity < 1:
            raise KvslimError(f"--sparsity must lie in (0, 1), got {sparsity}")
        return cls(sparsity=sparsity)

    @property
    def structured(self) -> bool:
        return self.m > 0

    @property
    def fraction(self) -> float:
        return self.sparsity if self.sparsity is not None else 1 - self.n / self.m

    def pruned_per_row(self, start: int, end: int) -> int:
        """Unstructured: how many of a row's columns [start, end) to prune, such that every
        row loses floor(sparsity * columns) in all however the columns are cut into blocks."""
        return int(end * self.sparsity) - int(start * self.sparsity)

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else f"{self.sparsity:.0%}"


def wanda_scores(weight: torch.Tensor, hessian_diag: torch.Tensor) -> torch.Tensor:
    return weight.abs().float() * hessian_diag.float().clamp(min=0).sqrt()[None, :]


def pruned_mask(scores: torch.Tensor, target: SparsityTarget) -> torch.Tensor:
    """scores [rows, n] -> bool [rows, n], True where a weight is pruned: the lowest scores of
    each row (unstructured) or of each group of m inputs (N:M)."""
    rows, n = scores.shape
    mask = torch.zeros(rows, n, dtype=torch.bool)
    if target.structured:
        groups = scores.reshape(rows, n // target.m, target.m)
        low = groups.topk(target.m - target.n, dim=-1, largest=False).indices
        return mask.view(rows, n // target.m, target.m).scatter_(-1, low, True).view(rows, n)
    k = target.pruned_per_row(0, n)
    if k:
        mask.scatter_(1, scores.topk(k, dim=1, largest=False).indices, True)
    return mask
