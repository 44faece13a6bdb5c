"""The GQA experiment end to end on a tiny model: every run recorded, resumable, a report with
tables, goal checks and plots written from the records."""
import json

from kvslim.surgery.experiment import Experiment, ExperimentConfig
from kvslim.surgery.experiment_report import goal_checks, write_report
from kvslim.surgery.train_config import ModelShape, TrainConfig
from kvslim.surgery.trainer import train


def test_tiny_experiment_runs_resumes_and_reports(tmp_path, calib_file):
    model = tmp_path / "ref"
    train(TrainConfig(data=str(calib_file), out=str(model), vocab_size=300, seq_len=32,
                      shape=ModelShape(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=4, intermediate_size=64),
                      steps=20, batch_size=4, warmup_steps=2, save_every=20, device="cpu"),
          show_progress=False)
    cfg = ExperimentConfig(model=str(model), train=str(calib_file), valid=str(calib_file),
                           test=str(calib_file), work_dir=str(tmp_path / "work"),
                           report=str(tmp_path / "docs" / "report.md"), kv_heads=[2, 1],
                           alphas=[0.0, 0.1], extra_alphas=[0.2], batch_size=4, seq_len=32, calib_samples=4,
                           ppl_context=32, ppl_stride=16, ppl_max_tokens=300, smollm2=False)
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
    assert (report.parent / "img" / "gqa-ppl-vs-alpha.png").stat().st_size > 10_000
    checks = goal_checks(again)
    assert any("align beats mean" in c[0] for c in checks)
    assert all(f"{r.test_ppl:.3f}" in text for r in again.results.values())
