"""Distillation uptraining: the loss is the documented formula, its teacher terms vanish for a
student identical to the teacher, and `kvslim uptrain --teacher` trains a converted model."""
import json
import math
import shutil

import pytest
import torch

from checkpoints import write_checkpoint
from kvslim.cli.main import main
from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model
from kvslim.models.config import ModelConfig
from kvslim.surgery.convert import convert_to_gqa
from kvslim.train.distill import Distiller, distill_loss
from kvslim.train.train_config import TrainConfig


@pytest.fixture(scope="module")
def mha_and_gqa(tmp_path_factory):
    """A tiny MHA checkpoint (4 KV heads) and its 2-KV-head conversion."""
    root = tmp_path_factory.mktemp("distill")
    mha = write_checkpoint("mha", root / "mha")
    gqa = convert_to_gqa(mha, root / "gqa", 2, "mean", show_progress=False)
    return mha, gqa


def _softmax(xs, t):
    e = [math.exp(x / t) for x in xs]
    return [v / sum(e) for v in e]


def test_distill_loss_matches_hand_computation():
    student = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]])      # [B=1, T=2, V=3]
    teacher = torch.tensor([[[2.0, 1.0, 0.0], [0.5, 0.5, 1.5]]])
    labels = torch.tensor([[1, 2]])
    t, w = 2.0, 0.25
    ce = kl = 0.0
    for s, te, y in zip(student[0].tolist(), teacher[0].tolist(), labels[0].tolist()):
        ce += -math.log(_softmax(s, 1.0)[y]) / 2
        p, q = _softmax(te, t), _softmax(s, t)
        kl += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)) / 2
    loss, parts = distill_loss(student, teacher, labels, t, w)
    assert parts.ce.item() == pytest.approx(ce, rel=1e-6)
    assert parts.kl.item() == pytest.approx(kl, rel=1e-5)
    assert loss.item() == pytest.approx((1 - w) * ce + w * t * t * kl, rel=1e-6)
    assert kl > 0.01                       # the example is not degenerate


def test_kl_vanishes_for_a_student_identical_to_the_teacher():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    loss, parts = distill_loss(logits, logits.clone(), labels, 3.0, 0.7)
    assert parts.kl.abs().item() < 1e-6
    assert loss.item() == pytest.approx(0.3 * parts.ce.item(), rel=1e-5)


def test_attention_term_zero_for_identical_models_positive_otherwise(mha_and_gqa):
    mha, gqa = mha_and_gqa
    batch = torch.randint(0, 300, (2, 9))
    distiller = Distiller(load_model(mha), 2.0, 0.5, attention_weight=1.0)
    same = distiller(load_model(mha), batch)
    assert distiller.last_parts.attention.item() == 0.0
    assert distiller.last_parts.kl.abs().item() < 1e-6
    assert same.item() == pytest.approx(0.5 * distiller.last_parts.ce.item(), rel=1e-5)
    student = load_model(gqa).train()
    loss = distiller(student, batch)
    assert distiller.last_parts.attention.item() > 1e-4
    assert distiller.last_parts.kl.item() > 1e-4
    loss.backward()                                  # gradients reach the student only
    assert student.model.layers[0].self_attn.qkv_proj.weight.grad is not None
    assert all(p.grad is None for p in distiller.teacher.parameters())


def _uptrain_args(gqa, out, calib, *extra):
    return ["uptrain", str(gqa), "--data", str(calib), "--out", str(out), "--steps", "4",
            "--batch-size", "2", "--seq-len", "16", "--lr", "1e-3", "--device", "cpu",
            "--quiet", "--json", *extra]


def test_uptrain_with_teacher_end_to_end(mha_and_gqa, calib_file, tmp_path, capsys):
    mha, gqa = mha_and_gqa
    out = tmp_path / "up"
    code = main(_uptrain_args(gqa, out, calib_file, "--teacher", str(mha),
                              "--distill-temperature", "2", "--distill-weight", "0.5",
                              "--match-attention", "--attention-weight", "0.1"))
    assert code == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["step"] == 4 and math.isfinite(metrics["loss"])
    assert ModelConfig.from_dir(out).num_key_value_heads == 2
    trained = load_model(out)
    assert torch.isfinite(trained.logits(torch.randint(0, 300, (1, 8)))).all()
    before = load_model(gqa).model.layers[0].self_attn.qkv_proj.weight
    assert not torch.equal(trained.model.layers[0].self_attn.qkv_proj.weight, before)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    return err


def test_teacher_with_another_vocab_size_is_one_line_error(mha_and_gqa, calib_file, tmp_path,
                                                           capsys):
    mha, gqa = mha_and_gqa
    teacher = tmp_path / "teacher"
    shutil.copytree(mha, teacher)
    config = json.loads((teacher / "config.json").read_text())
    config["vocab_size"] = 512
    (teacher / "config.json").write_text(json.dumps(config))
    assert main(_uptrain_args(gqa, tmp_path / "up", calib_file, "--teacher", str(teacher))) == 2
    err = _one_line_error(capsys)
    assert "vocab_size 512" in err and "320" in err


def test_teacher_with_another_tokenizer_is_one_line_error(mha_and_gqa, calib_file, tmp_path,
                                                          capsys):
    mha, gqa = mha_and_gqa
    teacher = tmp_path / "teacher"
    shutil.copytree(mha, teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]         # swap two ids: same size, other map
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    assert main(_uptrain_args(gqa, tmp_path / "up", calib_file, "--teacher", str(teacher))) == 2
    err = _one_line_error(capsys)
    assert "different tokenizer vocabulary" in err and "2 of them with another id" in err


@pytest.mark.parametrize("flag, value, message", [
    ("--distill-weight", "1.5", "--distill-weight must be in [0, 1], got 1.5"),
    ("--distill-weight", "-0.1", "--distill-weight must be in [0, 1], got -0.1"),
    ("--distill-temperature", "0", "--distill-temperature must be positive, got 0.0"),
    ("--distill-temperature", "-2", "--distill-temperature must be positive, got -2.0"),
])
def test_bad_distillation_flags_are_one_line_errors(mha_and_gqa, calib_file, tmp_path, capsys,
                                                    flag, value, message):
    mha, gqa = mha_and_gqa
    args = _uptrain_args(gqa, tmp_path / "up", calib_file, "--teacher", str(mha), flag, value)
    assert main(args) == 2
    assert message in _one_line_error(capsys)
    assert not (tmp_path / "up").exists()                # rejected before anything is written


def test_match_attention_needs_a_teacher(tmp_path):
    with pytest.raises(KvslimError, match="--match-attention needs --teacher"):
        TrainConfig(data="x", out=str(tmp_path), match_attention=True)
