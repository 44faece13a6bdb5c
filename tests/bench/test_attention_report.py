"""The attention-backend section of docs/benchmarks.md: pending until each script has written
its JSON, then its table, with failures shown as such."""
import json

from kvslim_lab.bench.attention_report import attention_section, gpu_goals, gpu_table

ENGINE = dict(backend="flex", graphs=True, startup_s=12.5, decode_tok_s=410.2, gb_s=221.0,
              hbm_fraction=0.046, throughput_tok_s=9000.0, tokens_identical=True,
              first_difference=None, batched_equals_alone=8)
GPU = dict(command="python benchmarks/cuda_decode_check.py", smoke=False, device="cuda",
           hbm_gbps=4800.0, plan=dict(batch=64, new_tokens=128, check_prompts=8),
           notes=["device: H200"],
           models=[dict(model="SmolLM2-135M", dtype="float32", strict=True, engines=[
               ENGINE, dict(ENGINE, graphs=False, tokens_identical=False, first_difference=[2, 5]),
               dict(backend="gather", graphs=True, startup_s=3.0, error="RuntimeError: boom")],
               hf=dict(label="HF transformers 5.23.0", decode_tok_s=50.0, gb_s=27.0,
                       hbm_fraction=0.0056, throughput_tok_s=1500.0, best_batch=64))])


def test_pending_without_measurements(tmp_path):
    text = attention_section(tmp_path)
    assert "Not measured yet: `python benchmarks/paged_attention_choice.py" in text
    assert "Pending: not run on a GPU yet" in text


def test_gpu_table_from_the_checks_json(tmp_path):
    (tmp_path / "cuda_decode_check.json").write_text(json.dumps(GPU))
    text = attention_section(tmp_path)
    assert "Pending" not in text and gpu_table(GPU) in text
    rows = gpu_table(GPU).splitlines()
    assert "offline tok/s (64 x 128)" in rows[0]
    assert rows[2] == ("| SmolLM2-135M (float32) | kvslim flex, CUDA graphs | yes | 8 of 8 | "
                       "410.2 | 221.0 | 5% | 9000.0 | 12.5 |")
    assert "| no (prompt, token) [2, 5] |" in rows[3]
    assert "| error: RuntimeError: boom |" in rows[4]
    assert rows[5].startswith("| SmolLM2-135M (float32) | HF transformers 5.23.0, best batch 64 |")
    assert rows[-1] == "- device: H200"


def test_a_smoke_run_is_not_a_gpu_table(tmp_path):
    (tmp_path / "cuda_decode_check.json").write_text(json.dumps(dict(GPU, smoke=True)))
    assert "Pending: not run on a GPU yet" in attention_section(tmp_path)


def test_goals_and_unmeasured_rates(tmp_path):
    # a negative rate timed a compilation: shown as not measured, and left out of the goals
    compiled_in = dict(ENGINE, decode_tok_s=-211.7, gb_s=-115.8, hbm_fraction=-0.024)
    llama = dict(model="llama-1B-random", dtype="bfloat16", strict=False,
                 engines=[dict(ENGINE, backend="gather"), compiled_in],
                 hf=dict(GPU["models"][0]["hf"], throughput_tok_s=2000.0))
    report = dict(GPU, models=[GPU["models"][0], llama],
                  quantized=dict(model="llama-1B-random", kernels=[
                      dict(kernel="int4-g32", path="torch int4 op", max_rel_error=0.0041,
                           rows_batch_invariant=False)], engines=[
                      dict(weights="bfloat16", decode_tok_s=351.2, throughput_tok_s=8455.7,
                           prompts_equal_bf16=8, prompts=8, startup_s=1.29,
                           batched_equals_alone=7),
                      dict(weights="int4-g32", error="RuntimeError: device")]))
    rows = gpu_table(report).splitlines()
    assert ("| llama-1B-random (bfloat16) | kvslim flex, CUDA graphs | yes | 8 of 8 | not "
            "measured (a compilation fell inside the timing) | — | — | 9000.0 | 12.5 |") in rows
    assert "| weights = bfloat16 | 351.2 | 8455.7 | 8 of 8 | 7 of 8 | 1.3 |" in rows
    assert "| weights = int4-g32 | — | RuntimeError: device | — | — | — |" in rows
    assert "| int4-g32 | torch int4 op | 4.10e-03 | no |" in rows
    goals = gpu_goals(report).splitlines()
    assert "- SmolLM2-135M (float32): greedy parity on every engine FAIL" in goals
    assert "- llama-1B-random (bfloat16): greedy parity on every engine PASS" in goals
    assert ("- llama-1B-random (bfloat16): batched = alone on every engine, 8 of 8 prompts at "
            "worst PASS") in goals
    assert ("- llama-1B-random: batch-1 8.2x HF transformers (>= 3x: PASS), offline 4.5x "
            "(>= 5x: FAIL)") in goals
    assert "- llama-1B-random: batch-1 decode at 5% of HBM bandwidth (>= 70%: FAIL)" in goals
    assert not any("SmolLM2-135M: batch-1 decode at" in g for g in goals)


PROFILE = dict(steps=16, wall_ms_per_step=2.66, host_ms_outside_phases=0.31,
               host_ms_per_step=dict(schedule=0.05, prepare=0.2, graph=0.9, logits=0.1,
                                     sample=0.4, postprocess=0.05),
               device_busy_ms_per_step=0.8, device_idle_fraction=0.7,
               kernel_launches_per_step=21.0, graph_launches_per_step=1.0,
               top_kernels=[dict(name="sm90_xmma_gemm_bf16", ms_per_step=0.41,
                                 calls_per_step=64.0)])


def test_profiled_engines_get_a_table_of_where_the_step_goes():
    profiled = dict(GPU, models=[dict(GPU["models"][0], engines=[
        dict(ENGINE, backend="gather", profile=PROFILE), dict(ENGINE, batched_equals_alone=6)])])
    rows = gpu_table(profiled).splitlines()
    header = next(i for i, r in enumerate(rows) if r.startswith("| model | engine | step |"))
    assert rows[header + 1].count("---|") == rows[header].count("|") - 1
    assert rows[header + 2] == ("| SmolLM2-135M | gather, graphs | 2.66 | 0.80 | 70% | 21.0 | "
                                "1.0 | 0.05 | 0.20 | 0.90 | 0.10 | 0.40 | 0.05 | 0.31 |")
    assert ("| SmolLM2-135M | gather, graphs | `sm90_xmma_gemm_bf16` | 0.410 | 64.0 |"
            in rows)
    goals = gpu_goals(profiled).splitlines()
    assert ("- SmolLM2-135M (float32): batched = alone on every engine, 6 of 8 prompts at "
            "worst FAIL") in goals
