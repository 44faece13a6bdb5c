"""`kvslim experiment speculative` end to end on tiny random models: every cell measured, greedy
outputs identical, the report's tables, thresholds and goal lines computed from the runs."""
import json

from checkpoints import TOKENIZER_TEXT
from kvslim_lab.experiments.speculative.records import SpecExperimentConfig, Target
from kvslim_lab.experiments.speculative.report import goal_checks, write_report
from kvslim_lab.experiments.speculative.study import SpecExperiment
from kvslim_lab.experiments.speculative.thresholds import break_even_acceptance, cells


def test_break_even_acceptance_solves_the_geometric_sum():
    assert break_even_acceptance(1.0, 4) == 0.0
    assert break_even_acceptance(5.5, 4) is None                  # more than k + 1 tokens
    a = break_even_acceptance(2.0, 3)
    assert abs(1 + a + a ** 2 + a ** 3 - 2.0) < 1e-9


def test_experiment_runs_and_reports(hf_checkpoints, tmp_path):
    text = tmp_path / "test.txt"
    text.write_text(TOKENIZER_TEXT)
    target = Target("gqa", str(hf_checkpoints["gqa"]), {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},
        "self": {"method": "draft", "model": str(hf_checkpoints["gqa"]),
                 "num_speculative_tokens": 3}})
    cfg = SpecExperimentConfig([target], str(text), str(tmp_path / "work"), batch_sizes=[1, 2],
                               max_tokens=8, passage_tokens=20, repeats=2)
    exp = SpecExperiment(cfg, show_progress=False)
    exp.run()
    # two phases of (plain + 2 proposers), x 2 workloads x 2 batches x 2 repeats
    assert len(exp.runs) == 2 * 3 * 2 * 2 * 2
    assert all(r.identical for r in exp.runs)
    self_runs = [r for r in exp.runs if r.proposer == "self" and r.arm == "spec"]
    assert sum(r.accepted_tokens for r in self_runs) > 0
    table = cells(exp.runs)
    assert table[("gqa", "self", "free", 1, "spec")]["acceptance"] > 0.9
    measured = exp.thresholds["gqa"]
    assert set(measured) == {"ngram", "self"}
    for values in measured.values():         # the adaptive arm ran with what was measured
        assert values["settings"]["disable_by_batch_size"] in (1, 2)
        assert 0 <= values["settings"]["backoff_acceptance"] <= 1
    assert {r.arm for r in exp.runs if r.phase == 2} == {"plain", "adaptive"}
    goals = goal_checks(exp, table)
    assert goals[-1] == ("greedy speculative output identical to plain decoding in every run",
                         True, "all")
    report = write_report(exp, tmp_path / "docs" / "speculative.md", "kvslim experiment x", "m")
    body = report.read_text()
    assert "| gqa | self | free | 1 |" in body and "## Thresholds for adaptivity" in body
    assert "not measured to the end" not in body
    partial = SpecExperiment(SpecExperimentConfig(
        [target, Target("later", target.model, {})], str(text), str(tmp_path / "work"),
        batch_sizes=[1, 2], max_tokens=8, passage_tokens=20, repeats=2), show_progress=False)
    partial.runs, partial.thresholds = exp.runs, exp.thresholds
    body = write_report(partial, tmp_path / "p.md", "kvslim experiment x", "m").read_text()
    assert "not measured to the end yet: later (" in body
    assert (tmp_path / "docs" / "img" / "speculative_speedup.png").stat().st_size > 0
    saved = json.loads(exp.results_path.read_text())
    assert len(saved["runs"]) == len(exp.runs)
    exp2 = SpecExperiment(cfg, show_progress=False)
    exp2.reload()
    assert cells(exp2.runs).keys() == table.keys() and exp2.thresholds == exp.thresholds
    # A complete target is kept by the next run under the same settings, not measured again.
    assert exp2.run() == ["gqa"]
    assert exp2.runs == exp.runs and exp2.thresholds == exp.thresholds
    # A target whose first phase is complete goes on with its second only.
    saved = json.loads(exp.results_path.read_text())
    saved["runs"] = [r for r in saved["runs"] if r["phase"] == 1]
    saved["thresholds"] = {}
    exp.results_path.write_text(json.dumps(saved))
    exp3 = SpecExperiment(cfg, show_progress=False)
    assert exp3.run() == []
    first = [r for r in exp.runs if r.phase == 1]
    assert [r for r in exp3.runs if r.phase == 1] == first
    assert len(exp3.runs) == len(exp.runs) and set(exp3.thresholds) == {"gqa"}
    changed = SpecExperimentConfig([target], str(text), str(tmp_path / "work"),
                                   batch_sizes=[1, 2], max_tokens=9, passage_tokens=20,
                                   repeats=2)
    assert SpecExperiment(changed, show_progress=False)._completed_targets() == {}
    other = Target("gqa", str(hf_checkpoints["gqa"]), {"ngram": target.proposers["ngram"]})
    regrown = SpecExperimentConfig([other], str(text), str(tmp_path / "work"),
                                   batch_sizes=[1, 2], max_tokens=8, passage_tokens=20,
                                   repeats=2)
    assert SpecExperiment(regrown, show_progress=False)._completed_targets() == {}


def test_the_adaptive_goal_is_judged_overall_and_from_batch_8_on(tmp_path):
    exp = SpecExperiment(SpecExperimentConfig([Target("t", "m", {})], "x"), show_progress=False)
    cell = dict(identical=True)
    table = {("t", "ngram", "free", 1, "adaptive"): dict(cell, speedup=0.80),
             ("t", "ngram", "free", 8, "adaptive"): dict(cell, speedup=0.97),
             ("t", "draft", "grounded", 32, "adaptive"): dict(cell, speedup=1.10)}
    checks = {text.split(" (")[0]: (ok, detail) for text, ok, detail in goal_checks(exp, table)}
    assert checks["with adaptivity on, never slower than plain decoding"] == (
        False, "worst 0.80x (t, ngram, free, 1)")
    assert checks["with adaptivity on, never slower than plain decoding at batch >= 8"] == (
        True, "worst 0.97x (t, ngram, free, 8)")


def test_lookahead_goals_name_the_measured_reason(tmp_path):
    """Lookahead's goals: >= 1.3x at batch 1 on grounded text, with the depth-1 acceptance and
    the step cost beside a miss; its adaptive arm never below 0.95x."""
    spec = {"method": "lookahead"}
    exp = SpecExperiment(SpecExperimentConfig([Target("t", "m", {"lookahead": spec})], "x"),
                         show_progress=False)
    exp.thresholds = {"t": {"lookahead": dict(step_cost_ratio=1.4, break_even_acceptance=0.3)}}
    cell = dict(identical=True)
    table = {("t", "lookahead", "grounded", 1, "spec"): dict(cell, speedup=1.2,
                                                              acceptance_by_depth=[0.5, 0.2]),
             ("t", "lookahead", "free", 8, "adaptive"): dict(cell, speedup=0.96,
                                                              acceptance=None),
             ("t", "lookahead", "grounded", 1, "adaptive"): dict(cell, speedup=1.25)}
    checks = {text: (ok, detail) for text, ok, detail in goal_checks(exp, table)}
    assert checks["t: lookahead >= 1.3x batch-1 decode on the input-grounded workload"] == (
        False, "1.20x: depth-1 acceptance 0.50, a verification step costs 1.40 plain steps "
               "(break-even acceptance 0.30 per draft token)")
    assert checks["t: lookahead with its adaptive switch never below 0.95x"] == (
        True, "worst 0.96x (free, batch 8)")
