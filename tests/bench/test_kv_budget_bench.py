"""`kvslim bench kv-budget` on a tiny random model: the plan and every uniform rival fit the
same budget, each rival is the widest of its precision that does, the plan's held-out KL is
measured with all its layers at once and its engine run reads the plan, and the goals are
written PASS or FAIL with the figures."""
import json

import pytest

from checkpoints import TOKENIZER_TEXT, write_checkpoint
from kvslim.kv_cache.budget import KVSetting
from kvslim.models.config import ModelConfig
from kvslim_lab.bench.kv_budget import KVBudgetConfig, _costs, run_kv_budget, uniform_rivals
from kvslim_lab.bench.kv_budget_report import format_markdown, goals, write_report


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvb")
    (root / "text.txt").write_text(TOKENIZER_TEXT * 4)
    return write_checkpoint("gqa", root / "gqa"), root / "text.txt"


def test_each_rival_is_the_widest_of_its_precision_within_the_budget(tiny):
    config = ModelConfig.from_dir(tiny[0])
    cfg = KVBudgetConfig(context=256)
    cost = _costs(config, cfg)
    n = config.num_hidden_layers
    budget = sum(cost(l, KVSetting("int8")) for l in range(n)) // 2
    rivals = uniform_rivals(config, cfg, budget, cost)
    assert [r.precision for r in rivals] == ["auto", "int8", "int4", "int2"]
    assert rivals[-1].window is None                  # int2 fits whole
    for r in rivals:
        assert sum(cost(l, r) for l in range(n)) <= budget
        if r.window is not None:                      # a token more would not fit
            wider = KVSetting(r.precision, r.window + 1)
            assert sum(cost(l, wider) for l in range(n)) > budget


def test_the_plan_and_its_rivals_through_the_engine(tiny, tmp_path):
    model, text = tiny
    cfg = KVBudgetConfig(models=[str(model)], context=96, concurrency=16, windows=(16,),
                         calibration=str(text), calib_batches=1, data=str(text), kl_batches=1,
                         ppl_tokens=128, chunk=16, passkey_contexts=(64,),
                         passkey_depths=(0.5,))
    (mb,) = run_kv_budget(cfg, show_progress=False).models
    names = [c.name for c in mb.candidates]
    assert names[0] == "plan" and names[-1] == "exact" and len(names) >= 4
    for c in mb.candidates:
        assert c.measured_kl >= 0 and c.engine["error"] is None, c.engine
        assert c.engine["perplexity"] > 1
        assert (c.bytes_per_sequence <= mb.budget_per_sequence) == c.rival
    plan = mb.candidates[0]
    assert plan.predicted_kl >= 0 and plan.calibration_kl >= 0 and len(plan.layers) == 2
    assert plan.engine["options"] == {"kv_plan": plan.engine["options"]["kv_plan"]}
    assert mb.candidates[-1].measured_kl == pytest.approx(0, abs=1e-6)
    lines = goals(mb)
    assert len(lines) == 3 and all(l.startswith(("PASS: ", "FAIL: ")) for l in lines)


def test_the_report_is_written(tiny, tmp_path):
    model, text = tiny
    cfg = KVBudgetConfig(models=[str(model)], context=64, concurrency=1, windows=(16,),
                         precisions=("auto", "int8"), calibration=str(text), calib_batches=1,
                         data=str(text), kl_batches=1, ppl_tokens=64, chunk=16,
                         passkey_contexts=(48,), passkey_depths=(0.5,))
    result = run_kv_budget(cfg, show_progress=False)
    paths = write_report(result, tmp_path / "out")
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    assert json.loads(paths[0].read_text())["models"][0]["candidates"][0]["name"] == "plan"
    assert "| plan |" in format_markdown(result)
