"""The speculative study's section on learned drafters: a drafter trained by train_drafter,
measured by the study, reported with its training cost, its per-head accuracy and its
acceptance by depth; a drafter without a training log is named as such."""
import shutil

from checkpoints import TOKENIZER_TEXT
from kvslim_lab.experiments.speculative.drafters_report import drafters_section
from kvslim_lab.experiments.speculative.records import SpecExperimentConfig, Target
from kvslim_lab.experiments.speculative.report import goal_checks
from kvslim_lab.experiments.speculative.study import SpecExperiment
from kvslim_lab.experiments.speculative.thresholds import cells
from kvslim.train.drafter import LOG_FILE, DrafterTrainConfig, train_drafter


def test_a_trained_drafter_is_reported_with_cost_accuracy_and_depths(hf_checkpoints, tmp_path):
    model = str(hf_checkpoints["gqa"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"the kernel {i} memory" for i in range(8)))
    heads = tmp_path / "heads"
    log = train_drafter(DrafterTrainConfig(model, str(heads), str(prompts), chat=False, heads=2,
                                           tokens=8 * 16, max_answer_tokens=16, steps=10,
                                           batch_positions=32), show_progress=False)
    assert set(log["seconds"]) == {"answers", "hidden_states", "steps", "total"}
    seconds = log["seconds"]
    assert seconds["answers"] > 0          # generated here, not found in OUT
    assert abs(seconds["total"] - seconds["answers"] - seconds["hidden_states"]
               - seconds["steps"]) < 0.2
    bare = tmp_path / "bare"
    shutil.copytree(heads, bare)
    (bare / LOG_FILE).unlink()
    text = tmp_path / "test.txt"
    text.write_text(TOKENIZER_TEXT)
    medusa = {"method": "medusa", "num_speculative_tokens": 2}
    target = Target("gqa", model, {"heads": {**medusa, "model": str(heads)},
                                   "bare": {**medusa, "model": str(bare)}})
    exp = SpecExperiment(SpecExperimentConfig([target], str(text), str(tmp_path / "work"),
                                              batch_sizes=[1], max_tokens=8, passage_tokens=20,
                                              repeats=1), show_progress=False)
    exp.run()
    # batch 1 decodes min_prompts (4) prompts, one at a time: a token per engine step
    plain = [r for r in exp.runs if r.arm == "plain"]
    assert all(r.output_tokens > 8 and r.steps >= r.output_tokens for r in plain)
    spec = [r for r in exp.runs if r.arm == "spec" and r.proposer == "heads"]
    assert all(len(r.drafted_per_depth) == 2 and r.drafted_per_depth[0] == r.verifications
               for r in spec)
    assert all(r.drafted_per_depth == [] for r in exp.runs if r.arm == "plain")
    table = cells(exp.runs)
    depths = table[("gqa", "heads", "free", 1, "spec")]["acceptance_by_depth"]
    assert len(depths) == 2 and all(0 <= a <= 1 for a in depths) and depths[1] <= depths[0]
    body = drafters_section(exp, table)
    top1 = " / ".join(f"{v:.2f}" for v in log["final"]["top1"])
    assert f"| {heads} | medusa | 8 | 128 / 0 | 10 x 32 | " in body and top1 in body
    assert f"| {bare} | | no {LOG_FILE} |" in body
    assert "| gqa | heads | free | " + " / ".join(f"{a:.2f}" for a in depths) in body
    checks = goal_checks(exp, table)
    goals = {text: ok for text, ok, _ in checks}
    why = next(d for t, _, d in checks if t.startswith("gqa: learned drafter heads >= 2.0x"))
    assert f"depth-1 acceptance {depths[0]:.2f}, a verification step costs " in why
    assert goals[f"drafter {heads} trains in <= 2 h on this machine"]
    assert not any(str(bare) in text for text in goals)
    plain_only = SpecExperiment(SpecExperimentConfig(
        [Target("gqa", model, {"ngram": {"method": "ngram"}})], str(text)), show_progress=False)
    assert drafters_section(plain_only, {}) == ""
