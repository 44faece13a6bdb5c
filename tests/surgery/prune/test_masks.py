"""Pruning one matrix: exact patterns (per row for unstructured, per group of M inputs for
N:M) for every method, reconstruction error ordered SparseGPT < Wanda < magnitude on the
calibration inputs, SparseGPT's joint 4-bit codes, and the targets' one-line refusals."""
import pytest
import torch

from kvslim.errors import KvslimError
from kvslim.surgery.prune.masks import SparsityTarget
from kvslim.surgery.prune.model import prune_linear
from kvslim.surgery.quantize.gptq import Hessian
from kvslim.quantization import QuantSpec
from surgery.test_quantize import calibration, error

TARGETS = [SparsityTarget(sparsity=0.5), SparsityTarget(sparsity=0.3), SparsityTarget(n=2, m=4),
           SparsityTarget(n=4, m=8)]


def hessian_of(x):
    h = Hessian(x.shape[1])
    h.add(x)
    return h.matrix


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_patterns_are_exact(method, target):
    x, w = calibration(n=512, d=192)
    pruned, _ = prune_linear(w, method, target, hessian_of(x), None)
    zero = pruned == 0
    if target.structured:
        per_group = zero.view(w.shape[0], -1, target.m).sum(-1)
        assert torch.equal(per_group, torch.full_like(per_group, target.m - target.n))
    else:
        per_row = zero.sum(1)
        assert torch.equal(per_row, torch.full_like(per_row, int(192 * target.sparsity)))


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_reconstruction_error_orders_the_methods(target):
    """On the inputs they were calibrated on: SparseGPT (weights updated) < Wanda (input
    norms) < magnitude."""
    x, w = calibration(n=1024, d=192)
    h = hessian_of(x)
    errors = {m: error(x, w, prune_linear(w, m, target, h, None)[0])
              for m in ("magnitude", "wanda", "sparsegpt")}
    assert errors["sparsegpt"] < errors["wanda"] < errors["magnitude"], errors


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_kept_weights_are_quantized_and_pruned_ones_stay_zero(method):
    x, w = calibration(n=512, d=192)
    spec = QuantSpec(4, 64, False, True, "gptq")
    target = SparsityTarget(n=2, m=4)
    pruned, codes = prune_linear(w, method, target, hessian_of(x), spec)
    assert torch.equal(codes.dequantize().float(), pruned)
    kept = (pruned != 0).view(w.shape[0], -1, 4).sum(-1)        # a kept weight may round to 0
    assert kept.max() <= 2 and kept.float().mean() > 1.8
    assert codes.q.min() >= 0 and codes.q.max() < 16
    assert error(x, w, pruned) < 0.6


def test_targets_refuse_what_cannot_be_pruned():
    for sparsity, pattern, message in [(1.0, None, r"\(0, 1\)"), (0.0, None, r"\(0, 1\)"),
                                       (None, "4:2", "0 < N < M"), (None, "2-4", "must be N:M"),
                                       (0.5, "2:4", "exactly one"), (None, None, "exactly one")]:
        with pytest.raises(KvslimError, match=message):
            SparsityTarget.parse(sparsity, pattern)
    assert SparsityTarget.parse(None, "2:4").fraction == 0.5
