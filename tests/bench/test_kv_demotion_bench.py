"""`kvslim bench kv-demotion` on a tiny random model: under overload the preempting engine
preempts and the demoting one demotes instead (and preempts less); every run's continuations are scored; the
report is written with a row and the goals, PASS or FAIL with the figures; bad flags fail in
one line before any model loads."""
import json

import pytest

from checkpoints import TOKENIZER_TEXT, write_checkpoint
from kvslim.kernels import extension
from kvslim_lab.bench.kv_demotion import KVDemotionConfig, run_kv_demotion
from kvslim_lab.bench.kv_demotion_report import format_markdown, goals, write_report


# Demotion runs on kvslim's CPU decode kernel: without the extension the engine refuses it.
needs_kernels = pytest.mark.skipif(extension.disabled() or extension.missing_compiler() is not None,
                                   reason="demotion needs kvslim's extension")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvd")
    (root / "text.txt").write_text(TOKENIZER_TEXT * 8)
    model = write_checkpoint("gqa", root / "gqa")
    cfg = KVDemotionConfig(models=[str(model)], requests=6, prompt_tokens=48, max_tokens=32,
                           overload=2.0, repeats=1, free_memory="8MiB",
                           data=str(root / "text.txt"))
    return run_kv_demotion(cfg, show_progress=False)


@needs_kernels
def test_preemption_preempts_and_demotion_demotes_instead(result):
    (md,) = result.models
    assert md.blocks["preempt"] * 2 <= md.blocks_needed + 2     # about half of what they need
    assert md.unpressured.preemptions == 0 and md.unpressured.same_as_unpressured == 6
    (pre,), (dem,) = md.runs["preempt"], md.runs["demote"]
    assert pre.preemptions > 0 and pre.demoted_blocks == 0
    assert dem.preemptions < pre.preemptions and dem.demoted_blocks > 0
    assert pre.same_as_unpressured == 6                 # recomputation keeps the tokens
    assert min(md.unpressured.ppl, pre.ppl, dem.ppl) >= 1 and pre.ppl == md.unpressured.ppl


@needs_kernels
def test_the_report_is_written(result, tmp_path):
    paths = write_report(result, tmp_path)
    assert [p.name for p in paths] == ["kv_demotion.json", "kv_demotion.md", "kv_demotion.png"]
    data = json.loads(paths[0].read_text())
    assert set(data["models"][0]["runs"]) == {"preempt", "demote"}
    text = format_markdown(result)
    assert text.count("\n| ") == 2 and "x** (" in text      # the header and one model's row
    lines = goals(result.models[0])
    assert len(lines) == 2 and all(l.startswith(("PASS: ", "FAIL: ")) for l in lines)
    assert paths[2].stat().st_size > 0


@pytest.mark.parametrize("flags,message", [
    (["--overload", "1"], "--overload must be above 1"),
    (["--requests", "0"], "must be at least 1"),
])
def test_bad_flags_fail_in_one_line(flags, message, capsys):
    from kvslim.cli.main import main
    assert main(["bench", "kv-demotion", *flags]) != 0
    assert message in capsys.readouterr().err
