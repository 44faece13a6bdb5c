"""The GQA study's MLA arms on the tiny model: latent attention at the KV bytes of GQA-2 and MQA,
converted, scored and uptrained as the GQA arms are; decode timed against GQA at equal bytes;
their goal lines, table rows and plot."""
import json
from pathlib import Path

from test_gqa_experiment import tiny_setup

from kvslim_lab.experiments.gqa.goals import goal_checks
from kvslim_lab.experiments.gqa.report import write_report
from kvslim_lab.experiments.gqa.study import Experiment, RunResult
from kvslim.models.config import ModelConfig
from kvslim.surgery.mla.options import mla_widths
from kvslim.train.trainer import train


def test_mla_arms_have_gqa_bytes_uptrain_time_decode_and_report(tmp_path, calib_file,
                                                                 monkeypatch):
    import kvslim_lab.experiments.gqa.study as gqa
    configs = []
    monkeypatch.setattr(gqa, "train", lambda cfg, **kw: configs.append(cfg) or train(cfg, **kw))
    cfg = tiny_setup(tmp_path, calib_file, layers=2, kv_heads=[2, 1], alphas=[0.0, 0.05],
                     extra_alphas=[], methods=["align", "align-kd", "mla", "mla-kd",
                                               "mla-mha2mla"],
                     mla_kv_heads=[2, 1], decode_batches=[1, 2], decode_input_len=8,
                     decode_output_len=4, decode_repeats=1)
    exp = Experiment(cfg, show_progress=False)
    plan = [exp._name(j) for j in exp.jobs()]
    # conversions first, then the decode timings (they need only those), the distilled last;
    # mha2mla is scored before uptraining only
    assert plan[:7] == ["ref-k4-mha-a0", "ref-k1-align-a0", "ref-k1-mla-a0",
                        "ref-k1-mla-mha2mla-a0", "ref-k2-align-a0", "ref-k2-mla-a0",
                        "ref-k2-mla-mha2mla-a0"]
    assert plan[7:11] == ["decode-k2-b1", "decode-k2-b2", "decode-k1-b1", "decode-k1-b2"]
    assert plan[-4:] == ["ref-k1-align-kd-a0.05", "ref-k1-mla-kd-a0.05",
                         "ref-k2-align-kd-a0.05", "ref-k2-mla-kd-a0.05"]
    assert "ref-k2-mla-mha2mla-a0.05" not in plan and len(plan) == 20
    exp.run()
    r = exp.results
    for k in (2, 1):
        gqa_bytes = r[f"ref-k{k}-align-a0"].kv_bytes_per_token_bf16
        assert gqa_bytes == 2 * 2 * k * 8 * 2                        # layers, K+V, heads, d, bf16
        for arm in ("mla-a0", "mla-a0.05", "mla-kd-a0.05", "mla-mha2mla-a0"):
            assert r[f"ref-k{k}-{arm}"].kv_bytes_per_token_bf16 == gqa_bytes
    assert r["ref-k2-mla-a0"].mla == {"kv_lora_rank": 16, "qk_rope_head_dim": 16}
    assert r["ref-k1-mla-mha2mla-a0"].mla == {"kv_lora_rank": 8, "qk_rope_head_dim": 8}
    assert ModelConfig.from_dir(tmp_path / "work" / "ref-k2-mla-a0.05").mla is not None
    assert r["ref-k2-mla-a0.05"].train_tokens_per_s > 0
    assert r["ref-k2-mla-a0"].train_tokens_per_s is None                # not uptrained
    teachers = {Path(c.out).name: c.teacher for c in configs if c.init_from}
    assert teachers["ref-k2-mla-kd-a0.05"] == cfg.model and teachers["ref-k2-mla-a0.05"] is None
    assert set(exp.decode) == {"decode-k2-b1", "decode-k2-b2", "decode-k1-b1", "decode-k1-b2"}
    d = exp.decode["decode-k2-b2"]
    assert d.models == {"mla": "ref-k2-mla", "gqa": "ref-k2-align", "mla-gather": "ref-k2-mla",
                        "gqa-gather": "ref-k2-align"}
    assert set(d.kv_bytes_per_token_bf16.values()) == {128} and min(d.tokens_per_s.values()) > 0

    again = Experiment(cfg, show_progress=False)                      # resumes: all recorded
    assert again.missing() == [] and set(again.decode) == set(exp.decode)
    text = write_report(again, "kvslim experiment gqa").read_text()
    assert "| 2 (GQA-2 bytes, MLA 16 + 16) | mla |" in text
    assert "| 1 (MQA bytes, MLA 8 + 8) | mla-mha2mla |" in text
    assert "| GQA-2 | 128 | 2 |" in text                          # the decode table
    recorded = json.loads((tmp_path / "docs" / "report.json").read_text())
    assert "decode-k1-b1" in recorded and "ref-k1-mla-a0" in recorded
    lines = [c[0] for c in goal_checks(again)]
    for line in ("MLA at GQA-2's KV bytes beats GQA-2 (align) after alpha = 0.05 (mla)",
                 "MLA at MQA's KV bytes beats MQA (align-kd) after alpha = 0.05 (mla-kd)",
                 "MLA decode (absorbed matrices) no slower than MQA at equal KV bytes, batch 2"):
        assert line in lines, line
    assert sum("MLA decode" in line for line in lines) == 4
    assert (tmp_path / "docs" / "img" / "gqa-ppl-vs-kv-bytes.png").stat().st_size > 10_000


def test_mla_goals_after_alpha_005_and_smollm2_quarter(tmp_path, calib_file):
    cfg = tiny_setup(tmp_path, calib_file, kv_heads=[2], methods=["align", "mla"],
                     smollm2=True, smollm2_mla_steps=7)
    exp = Experiment(cfg, show_progress=False)
    names = [exp._name(j) for j in exp.jobs()]
    assert "smollm2-k0.75-mla-s0" in names and names[-1] != "smollm2-k0.75-mla-s7"
    assert names.index("smollm2-k0.75-mla-s7") > names.index("smollm2-k1-align-kd-s60")

    def run(name, model, k, method, ppl, bytes_, steps=0, alpha=0.05):
        return RunResult(name, model, k, method, alpha, steps, ppl, 2 * bytes_, bytes_, 100.0)
    exp.results = {r.name: r for r in [
        run("a", "ref", 2, "align", 33.0, 1536), run("b", "ref", 2, "mla", 32.0, 1536),
        run("o", "smollm2", 3, "original", 30.0, 23040, alpha=0.0),
        run("m", "smollm2", 0.75, "mla", 36.0, 5760, steps=7, alpha=0.0)]}
    checks = {c[0]: (c[1], c[2]) for c in goal_checks(exp)}
    assert checks["MLA at GQA-2's KV bytes beats GQA-2 (align) after alpha = 0.05 (mla)"] == (
        True, "32.000 vs 33.000, 1,536 vs 1,536 bytes/token")
    ok, detail = checks["SmolLM2 with a quarter of its KV bytes within 15% of its original "
                        "perplexity after at most 2M uptraining tokens"]
    assert not ok and "+20.0%" in detail and "896 tokens" in detail     # 7 x 4 x 32
    assert "9 tokens/s" in detail                                        # 896 in 100 s
    exp.results["m"].uptrain_steps = 0          # not uptrained: another arm's rate is given
    exp.results["k"] = run("k", "smollm2", 1, "align-kd", 90.0, 7680, steps=14, alpha=0.0)
    detail = next(c[2] for c in goal_checks(exp) if "a quarter" in c[0])
    assert "1,792 tokens (align-kd, another arm)" in detail and "18 tokens/s" in detail


def test_mla_widths_split_the_row_of_a_gqa_count():
    ref = _ref_config()
    assert mla_widths(ref, 2, "transmla", 0.25) == (32, 96)      # GQA-2's 128 per layer
    assert mla_widths(ref, 1, "transmla", 0.25) == (16, 48)      # MQA's 64
    assert mla_widths(ref, 2, "mha2mla", 0.25) == (4, 96)        # 4 RoPE dims x 8 KV heads
    assert mla_widths(ref, 1, "mha2mla", 0.5) == (4, 32)


def _ref_config() -> ModelConfig:
    """ref-mha's shape: 8 heads x 32, MHA, 6 layers."""
    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
        "num_attention_heads": 8, "num_key_value_heads": 8})
