"""The GQA experiment end to end on a tiny model: every run recorded, resumable, a report with
tables, goal checks and plots written from the records."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvslim_lab.experiments.gqa.report import goal_checks, write_report
from kvslim_lab.experiments.gqa.study import Experiment, ExperimentConfig
from kvslim.train.train_config import ModelShape, TrainConfig
from kvslim.train.trainer import train


def tiny_setup(tmp_path, calib_file, layers=1, **overrides) -> ExperimentConfig:
    model = tmp_path / "ref"
    train(TrainConfig(data=str(calib_file), out=str(model), vocab_size=300, seq_len=32,
                      shape=ModelShape(num_hidden_layers=layers, hidden_size=32,
                                       num_attention_heads=4,
                                       num_key_value_heads=4, intermediate_size=64),
                      steps=20, batch_size=4, warmup_steps=2, save_every=20, device="cpu"),
          show_progress=False)
    kw = dict(model=str(model), train=str(calib_file), valid=str(calib_file),
              test=str(calib_file), work_dir=str(tmp_path / "work"),
              report=str(tmp_path / "docs" / "report.md"), kv_heads=[2, 1],
              alphas=[0.0, 0.1], extra_alphas=[0.2], batch_size=4, seq_len=32, calib_samples=4,
              ppl_context=32, ppl_stride=16, ppl_max_tokens=300, smollm2=False,
              methods=["mean", "first", "random", "align"], extra_methods=["mean", "align"],
              sensitivity_samples=2)
    return ExperimentConfig(**{**kw, **overrides})


def test_tiny_experiment_runs_resumes_and_reports(tmp_path, calib_file):
    cfg = tiny_setup(tmp_path, calib_file)
    exp = Experiment(cfg, show_progress=False)
    assert exp.original_steps == 20
    exp.run()
    names = set(exp.results)
    # 3 controls + 2 K x (4 methods x 2 alphas + 2 methods at alpha 0.2)
    assert len(names) == 3 + 2 * (4 * 2 + 2)
    assert {r.uptrain_steps for r in exp.results.values()} == {0, 2, 4}
    assert exp.results["ref-k1-mean-a0"].kv_bytes_per_token_bf16 == 2 * 1 * 1 * 8 * 2
    recorded = json.loads((tmp_path / "work" / "results.json").read_text())
    assert set(recorded) == names
    again = Experiment(cfg, show_progress=False)      # resumes: nothing left to run
    assert set(again.results) == names
    report = write_report(again, "kvslim experiment gqa --tiny")
    text = report.read_text()
    assert "kvslim experiment gqa --tiny" in text and "| 1 (MQA) | align |" in text
    assert json.loads(report.with_suffix(".json").read_text()) == recorded   # the raw runs
    assert (report.parent / "img" / "gqa-ppl-vs-alpha.png").stat().st_size > 10_000
    checks = goal_checks(again)
    assert any("align beats mean" in c[0] for c in checks)
    assert all(f"{r.test_ppl:.3f}" in text for r in again.results.values())


def test_shards_split_the_plan_and_share_one_results_file(tmp_path, calib_file):
    cfg = tiny_setup(tmp_path, calib_file, kv_heads=[2], alphas=[0.0], extra_alphas=[0.1],
                     methods=["mean", "align"], extra_methods=["align"])
    first = Experiment(replace(cfg, shard=(0, 2)), show_progress=False)
    plan = [first._name(j) for j in first.jobs()]
    # alpha 0 first, the extra alpha last; the MHA control leads each alpha
    assert plan == ["ref-k4-mha-a0", "ref-k2-mean-a0", "ref-k2-align-a0", "ref-k4-mha-a0.1",
                    "ref-k2-align-a0.1"]
    first.run()
    assert set(first.results) == set(plan[0::2])
    text = write_report(first, "kvslim experiment gqa").read_text()
    assert "**Not run**" in text and "`ref-k2-mean-a0`" in text
    second = Experiment(replace(cfg, shard=(1, 2)), show_progress=False)
    second.run()
    recorded = json.loads((tmp_path / "work" / "results.json").read_text())
    assert set(recorded) == set(plan)                  # merged, nothing overwritten
    first.reload()
    assert first.missing() == []
    assert "**Not run**" not in write_report(first, "kvslim experiment gqa").read_text()


def test_nonuniform_and_distilled_arms(tmp_path, calib_file, monkeypatch):
    """-nu arms spend the uniform count's KV bytes per layer; -kd arms uptrain from a teacher."""
    import kvslim_lab.experiments.gqa.study as gqa
    configs = []
    monkeypatch.setattr(gqa, "train", lambda cfg, **kw: configs.append(cfg) or train(cfg, **kw))
    cfg = tiny_setup(tmp_path, calib_file, layers=3, kv_heads=[2], alphas=[0.0, 0.1],
                     extra_alphas=[], methods=["align", "align-kd", "align-nu", "align-nu-kd"])
    exp = Experiment(cfg, show_progress=False)
    exp.run()
    assert sorted(exp.results) == sorted(
        ["ref-k4-mha-a0", "ref-k4-mha-a0.1", "ref-k2-align-a0", "ref-k2-align-a0.1",
         "ref-k2-align-kd-a0.1", "ref-k2-align-nu-a0", "ref-k2-align-nu-a0.1",
         "ref-k2-align-nu-kd-a0.1"])
    nu, uniform = exp.results["ref-k2-align-nu-a0"], exp.results["ref-k2-align-a0"]
    assert nu.kv_bytes_per_token_bf16 == uniform.kv_bytes_per_token_bf16
    assert sum(nu.kv_heads_per_layer or [2, 2, 2]) == 6 and uniform.kv_heads_per_layer is None
    teachers = {Path(c.out).name: c.teacher for c in configs if c.init_from}
    assert teachers["ref-k2-align-kd-a0.1"] == cfg.model == teachers["ref-k2-align-nu-kd-a0.1"]
    assert teachers["ref-k2-align-a0.1"] is None and teachers["ref-k4-mha-a0.1"] is None
    text = write_report(exp, "kvslim experiment gqa").read_text()
    assert "| 2 (GQA-2 bytes, per layer) | align-nu |" in text
    checked = any("non-uniform beats uniform" in c[0] for c in goal_checks(exp))
    assert checked == bool(nu.kv_heads_per_layer)     # a uniform allocation is not compared


@pytest.mark.parametrize("shard,message", [("2/2", "need 0 <= I < N"), ("a/b", "must look like I/N")])
def test_bad_shard_is_one_line(shard, message):
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "experiment", "gqa",
                        "--shard", shard, "--report-only"], capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_processes_on_one_shard_share_the_jobs_as_a_queue(tmp_path, calib_file):
    """A job claimed by a live process is skipped by the others; a dead claimer's job is not."""
    import os
    cfg = tiny_setup(tmp_path, calib_file, kv_heads=[2], alphas=[0.0], extra_alphas=[],
                     methods=["mean"], extra_methods=[])
    exp = Experiment(cfg, show_progress=False)
    names = [exp._name(j) for j in exp.jobs()]
    assert names == ["ref-k4-mha-a0", "ref-k2-mean-a0"]
    (tmp_path / "work" / "ref-k4-mha-a0.claim").write_text(str(os.getppid()))   # alive
    (tmp_path / "work" / "ref-k2-mean-a0.claim").write_text("999999999")        # no such pid
    exp.run()
    assert set(exp.results) == {"ref-k2-mean-a0"}
    assert not (tmp_path / "work" / "ref-k2-mean-a0.claim").exists()           # released
