"""Training and uptraining: loss goes down, output loads in transformers, resume is exact."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig
from kvslim.formats.loader import load_model
from kvslim.surgery.convert import convert_to_gqa
from kvslim.train.train_config import ModelShape, TrainConfig
from kvslim.train import trainer
from kvslim.train.trainer import train


def tiny_train_config(calib_file, out, **kw):
    base = dict(data=str(calib_file), valid=str(calib_file), out=str(out), vocab_size=300,
                shape=ModelShape(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                 num_key_value_heads=4, intermediate_size=64),
                seq_len=32, steps=30, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=15,
                eval_windows=8, save_every=15, log_every=5, seed=0, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def read_log(out):
    return [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]


def test_train_then_uptrain_lowers_loss(tmp_path, calib_file):
    out = tmp_path / "mha"
    train(tiny_train_config(calib_file, out), show_progress=False)
    log = read_log(out)
    assert log[-1]["val_loss"] < log[0]["loss"] - 1.0
    with torch.no_grad():                               # HF loads what kvslim trained
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids = torch.randint(0, 300, (1, 12))
        assert (hf(ids).logits - load_model(out).logits(ids)).abs().max() < 1e-4
    gqa = convert_to_gqa(out, tmp_path / "gqa", 1, "mean", show_progress=False)
    up = tmp_path / "gqa-up"
    train(tiny_train_config(calib_file, up, init_from=str(gqa), steps=12, lr=1e-3,
                            warmup_steps=2, eval_every=12, save_every=12), show_progress=False)
    up_log = read_log(up)
    assert up_log[-1]["loss"] < up_log[0]["loss"]
    assert ModelConfig.from_dir(up).num_key_value_heads == 1


def test_resume_continues_exactly(tmp_path, calib_file):
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_train_config(calib_file, full, steps=10, save_every=5, eval_every=10),
          show_progress=False)
    train(tiny_train_config(calib_file, part, steps=10, save_every=5, eval_every=10),
          show_progress=False)
    # Rewind `part` to its step-5 checkpoint by retraining 5 steps, then resume to 10.
    train(tiny_train_config(calib_file, part, steps=5, save_every=5, eval_every=5),
          show_progress=False)
    train(tiny_train_config(calib_file, part, steps=10, save_every=5, eval_every=10,
                            resume=True), show_progress=False)
    a, b = load_model(full).hf_state_dict(), load_model(part).hf_state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_resume_without_state_fails(tmp_path, calib_file):
    with pytest.raises(KvslimError, match="--resume"):
        train(tiny_train_config(calib_file, tmp_path / "x", resume=True), show_progress=False)


def test_empty_data_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(KvslimError, match="empty"):
        train(tiny_train_config(empty, tmp_path / "x"), show_progress=False)


def test_compiled_step_trains_as_eager(tmp_path, calib_file, monkeypatch):
    # --compile-step: the loss's forward and backward traced once, then eager's losses
    monkeypatch.setattr(trainer, "COMPILE_BACKEND", "aot_eager")
    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or
                        real_compile(fn, **kw))
    runs = {}
    for mode in (False, True):
        out = tmp_path / f"compile-{mode}"
        train(tiny_train_config(calib_file, out, steps=6, log_every=1, eval_every=6,
                                save_every=6, compile_step=mode), show_progress=False)
        runs[mode] = [r["loss"] for r in read_log(out)]
    assert compiled == [{"backend": "aot_eager"}]
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)
    assert len(runs[True]) == 6 and runs[True][-1] < runs[True][0]
