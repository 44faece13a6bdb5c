"""Uptraining a pruned model keeps its zeros: every weight `kvslim prune` zeroed is still exactly
zero after steps that change the kept ones, with and without a teacher, and the result is still
marked as pruned."""
import pytest
import torch

from kvslim.formats.loader import load_model
from kvslim.models.config import ModelConfig
from kvslim.surgery.prune.masks import SparsityTarget
from kvslim.surgery.prune.model import prune_model
from kvslim.train.pruned_masks import PrunedMasks
from kvslim.train.trainer import train
from train.test_train import tiny_train_config


def decoder_matrices(model_dir):
    model = load_model(model_dir, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.model.layers.named_parameters()
            if p.dim() == 2}


@pytest.mark.parametrize("teacher", [False, True], ids=["labels", "distilled"])
def test_uptraining_keeps_the_pruned_zeros(tmp_path, calib_file, teacher):
    dense = tmp_path / "dense"
    train(tiny_train_config(calib_file, dense, steps=10), show_progress=False)
    pruned = prune_model(dense, tmp_path / "pruned", "magnitude", SparsityTarget(n=2, m=4),
                         show_progress=False)
    up = tmp_path / "up"
    train(tiny_train_config(calib_file, up, init_from=str(pruned), steps=6, lr=1e-2,
                            warmup_steps=1, eval_every=6, save_every=6,
                            teacher=str(dense) if teacher else None), show_progress=False)
    before, after = decoder_matrices(pruned), decoder_matrices(up)
    for name, w in before.items():
        zero = w == 0
        assert zero.float().mean() >= 0.5, name
        assert (after[name][zero] == 0).all(), f"{name}: a pruned weight came back"
        assert not torch.equal(after[name][~zero], w[~zero]), f"{name}: kept weights untrained"
    assert ModelConfig.from_dir(up).pruning["pattern"] == "2:4"


def test_a_model_never_pruned_has_no_masks(tmp_path, calib_file):
    dense = tmp_path / "dense"
    train(tiny_train_config(calib_file, dense, steps=2, eval_every=2, save_every=2),
          show_progress=False)
    assert PrunedMasks.of(load_model(dense)) is None
    pruned = prune_model(dense, tmp_path / "p", "magnitude", SparsityTarget(sparsity=0.3),
                         show_progress=False)
    masks = PrunedMasks.of(load_model(pruned))
    shapes = [kept.shape for _, kept in masks.masks]      # floor(0.3 x inputs) per row
    expected = sum(o * int(0.3 * i) for o, i in shapes) / sum(o * i for o, i in shapes)
    assert masks.sparsity() == pytest.approx(expected)
