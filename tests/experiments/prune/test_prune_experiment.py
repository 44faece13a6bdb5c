"""`kvslim experiment prune` end to end on a tiny random model: every arm recorded with numbers,
the stored zeros matching each target, a recovered arm that keeps them, a rerun that builds
nothing again, a report whose goal lines follow from its records; bad settings refused."""
import json

import pytest

from kvslim.cli.main import main
from kvslim_lab.experiments.prune.goals import goals
from kvslim_lab.experiments.prune.report import write_report
from kvslim_lab.experiments.prune.study import PruneExperiment, PruneExperimentConfig

TEXT = ("The kernel schedules tasks; memory is managed in pages of 4096 bytes. It is a truth "
        "universally acknowledged, that a single man in possession of a good fortune, must be "
        "in want of a wife. In the beginning God created the heaven and the earth.\n") * 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from checkpoints import write_checkpoint
    root = tmp_path_factory.mktemp("prune")
    model = write_checkpoint("mha", root / "tiny")
    (root / "calib.txt").write_text(TEXT)
    (root / "test.txt").write_text(TEXT[::-1] + TEXT)
    cfg = PruneExperimentConfig(
        models=[str(model)], targets=["0.5", "2:4"], quantized_targets=["2:4"], group_size=32,
        calib=str(root / "calib.txt"), test=str(root / "test.txt"), work_dir=str(root / "work"),
        report=str(root / "docs" / "pruning.md"), calib_samples=4, calib_seq_len=32,
        ppl_context=32, ppl_stride=32, ppl_max_tokens=256, recover=["sparsegpt-s50"],
        recover_models=["tiny"], recovery_tokens=2 * 4 * 32, recovery_batch_size=4,
        recovery_seq_len=32, decode_input_len=4, decode_output_len=4, decode_repeats=1,
        show_progress=False)
    exp = PruneExperiment(cfg)
    exp.run()
    return exp


def test_every_arm_is_measured(tiny):
    results = {r.arm: r for r in tiny.results.values()}
    assert set(results) == {a.name for a in tiny.arms("tiny")}
    assert len(results) == 1 + 6 + 1 + 3 + 1
    for r in results.values():
        assert r.status == "done", (r.arm, r.reason)
        assert r.numbers["ppl"] > 1 and r.numbers["linear_bytes"] > 0
    assert results["dense"].numbers["linear_zeros"] < 0.01
    for name in ("magnitude-s50", "wanda-2of4", "sparsegpt-s50", "sparsegpt-s50+rec"):
        assert results[name].numbers["linear_zeros"] >= 0.5, name
    assert results["sparsegpt-s50+rec"].numbers["ppl"] != results["sparsegpt-s50"].numbers["ppl"]
    assert results["dense-w4"].numbers["linear_bytes"] < results["dense"].numbers["linear_bytes"]
    for name in ("dense", "dense-w4", "sparsegpt-s50", "sparsegpt-2of4", "sparsegpt-2of4-w4"):
        assert results[name].numbers["decode_tokens_per_s"] > 0, name
    assert "decode_tokens_per_s" not in results["wanda-s50"].numbers
    for name in ("sparsegpt-s50", "wanda-2of4"):          # compressed-tensors: values + bitmask
        n = results[name].numbers
        assert 0.5 < n["sparse_linear_bytes"] / n["linear_bytes"] < 0.6, name
    assert "sparse_linear_bytes" not in results["sparsegpt-2of4-w4"].numbers


def test_numbers_added_later_are_measured_on_recorded_arms(tiny, tmp_path):
    import shutil
    from kvslim_lab.experiments.prune.study import RESULTS
    work = tmp_path / "work"
    shutil.copytree(tiny.cfg.work_dir, work)
    records = json.loads((work / RESULTS).read_text())
    # One arm's decode deleted: every decode arm is timed again, in one run (the stale value
    # of the other, here a sentinel, replaced).
    records["tiny/dense"]["numbers"].pop("decode_tokens_per_s")
    records["tiny/sparsegpt-2of4"]["numbers"]["decode_tokens_per_s"] = -1.0
    records["tiny/wanda-s50"]["numbers"].pop("sparse_linear_bytes")
    (work / RESULTS).write_text(json.dumps(records))
    cfg = PruneExperimentConfig(**{**tiny.cfg.__dict__, "work_dir": str(work)})
    again = PruneExperiment(cfg)
    again.run()
    for key in ("tiny/sparsegpt-2of4", "tiny/dense"):
        assert again.results[key].numbers["decode_tokens_per_s"] > 0
    assert (again.results["tiny/wanda-s50"].numbers["sparse_linear_bytes"]
            == tiny.results["tiny/wanda-s50"].numbers["sparse_linear_bytes"])


def test_a_rerun_builds_nothing_and_the_report_follows_the_records(tiny):
    before = json.dumps({k: v.numbers for k, v in tiny.results.items()}, sort_keys=True)
    again = PruneExperiment(tiny.cfg)
    again.run()
    assert json.dumps({k: v.numbers for k, v in again.results.items()}, sort_keys=True) == before
    report = write_report(again, "kvslim experiment prune ...", {"cpu": "test"})
    text = report.read_text()
    for g in goals(again):
        assert g.line() in text
    assert "| 2:4 |" in text and "Recovery uptraining" in text and "sparse-24-bitmask" in text
    assert "Batch-1 decode" in text
    assert (report.parent / "img" / "pruning.png").is_file()
    data = json.loads(report.with_suffix(".json").read_text())
    assert set(data["arms"]) == set(again.results)


@pytest.mark.parametrize("flags,message", [
    (["--methods", "lottery"], "unknown --methods lottery"),
    (["--targets", "1.5"], "must lie in (0, 1)"),
    (["--targets", "0.5", "--recover", "wanda-s90"], "--recover names arms not pruned")])
def test_bad_settings_are_refused_in_one_line(tmp_path, capsys, flags, message):
    assert main(["experiment", "prune", "--work-dir", str(tmp_path / "w"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not (tmp_path / "w").exists()
