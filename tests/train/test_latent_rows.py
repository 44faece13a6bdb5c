"""Uptraining a latent attention converted with an exact latent norm (train/latent_rows.py): its
scaled latent rows train at their own scale, where plain AdamW swamps them; which models have
such rows."""
import math

import pytest
import torch

from kvslim.formats.loader import load_model
from kvslim.layers.latent_attention import LATENT_NORM_EPS
from kvslim.surgery.mla.convert import convert_to_mla
from kvslim.surgery.mla.options import MLAOptions
from kvslim.train import trainer
from kvslim.train.latent_rows import ExactLatentRows
from kvslim.train.trainer import train
from train.test_train import tiny_train_config

RANK = 12


@pytest.fixture(scope="module")
def converted(hf_checkpoints, calib_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("latent-rows")
    return {norm: convert_to_mla(hf_checkpoints["gqa"], root / norm,
                                 MLAOptions("transmla", RANK, 6, norm, calib_file, 4, 32),
                                 show_progress=False)
            for norm in ("exact", "calibrated")}


def latent_rows(model_dir) -> list[torch.Tensor]:
    layers = load_model(model_dir, dtype=torch.float32).model.layers
    return [layer.self_attn.kv_a_proj_with_mqa.weight.detach()[:RANK].clone()
            for layer in layers]


def uptrain(src, out, calib_file):
    train(tiny_train_config(calib_file, out, init_from=str(src), steps=3, lr=1e-3,
                            warmup_steps=1, eval_every=3, save_every=3, seq_len=16,
                            batch_size=2), show_progress=False)
    return out


def test_exact_rows_are_found_with_their_scale(converted, hf_checkpoints):
    rows = ExactLatentRows.of(load_model(converted["exact"], dtype=torch.float32))
    model = load_model(converted["exact"], dtype=torch.float32)
    assert len(rows.rows) == len(model.model.layers)
    for (weight, rank, alpha), layer in zip(rows.rows, model.model.layers):
        norm = layer.self_attn.kv_a_layernorm.weight
        assert rank == RANK and weight.shape[0] == RANK + 6
        assert alpha == pytest.approx(math.sqrt(LATENT_NORM_EPS) / norm.abs().mean().item())
        assert alpha < 1e-3
    assert ExactLatentRows.of(load_model(converted["calibrated"])) is None
    assert ExactLatentRows.of(load_model(hf_checkpoints["deepseek_v2"])) is None


def test_exact_rows_train_at_their_scale(converted, calib_file, tmp_path, monkeypatch):
    before = latent_rows(converted["exact"])
    after = latent_rows(uptrain(converted["exact"], tmp_path / "kept", calib_file))
    for b, a in zip(before, after):
        assert not torch.equal(a, b)
        change = ((a - b).norm() / b.norm()).item()
        assert 0 < change < 0.5                        # a training step's size, not a new matrix
    # Without it, AdamW's first steps (about lr each) are many times the rows themselves.
    monkeypatch.setattr(trainer.ExactLatentRows, "of", classmethod(lambda cls, model: None))
    swamped = latent_rows(uptrain(converted["exact"], tmp_path / "swamped", calib_file))
    assert all((a - b).norm() > 100 * b.norm() for a, b in zip(swamped, before))
