"""The engine benchmarks as commands: they run, compare in one process, and --json parses.
(Speed itself is measured by `kvslim bench report`, never asserted in a test.)"""
import json
import subprocess
import sys

import pytest
import torch

from kvslim_lab.bench.capacity import conversions, run_capacity
from kvslim_lab.bench.latency import run_latency
from kvslim_lab.bench.throughput import run_throughput
from kvslim_lab.bench.workload import Workload
from kvslim.errors import KvslimError
from kvslim_lab.bench.runners import parse_compare
from kvslim.models.config import ModelConfig
from kvslim.parallel.memory import tensor_parallel_memory


def test_throughput_runs_kvslim_and_hf_on_the_same_work(hf_checkpoints):
    r = run_throughput(hf_checkpoints["gqa"], Workload(6, 12, 8), ["hf"], hf_batch_size=4,
                       kv_cache_memory="4MiB", show_progress=False)
    assert [e.engine for e in r.results] == ["kvslim", "hf"]
    assert all(e.output_tokens_per_s > 0 for e in r.results)
    d = r.to_dict()
    assert d["ratios"]["kvslim/hf"] > 0 and d["workload"]["num_prompts"] == 6


def test_latency_reports_roofline_fractions(hf_checkpoints):
    r = run_latency(hf_checkpoints["gqa"], input_len=10, output_len=6, batches=(1, 2),
                    compare=["hf"], show_progress=False, repeats=3)
    assert [(e.engine, e.batch) for e in r.results] == [("kvslim", 1), ("kvslim", 2),
                                                         ("hf", 1), ("hf", 2)]
    for e in r.results:                        # every round kept; the table shows the median
        assert len(e.tpot_runs_s) == 3 and e.tpot_s == sorted(e.tpot_runs_s)[1]
    assert r.bandwidth.read_gb_s > 0
    e = r.results[1]
    assert e.bytes_per_step == r.weight_bytes + 2 * (10 + 3) * r.kv_bytes_per_token
    assert e.fraction_of_bandwidth > 0


def test_latency_with_tensor_parallel_ranks_counts_every_ranks_cache(hf_checkpoints):
    """2 ranks: each holds half the KV heads, so a step reads the whole model's cache; the
    label says how kvslim ran. Through the CLI, --json carries the degree."""
    path = hf_checkpoints["gqa"]
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "bench", "latency",
                        "--model", str(path), "--input-len", "8", "--output-len", "4",
                        "--batches", "1,2", "--compare", "", "--repeats", "1",
                        "--tensor-parallel-size", "2", "--tensor-parallel-oversubscribe",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    config = ModelConfig.from_dir(path)
    per_rank = tensor_parallel_memory(config, 2, "fp32", "fp32").kv_bytes_per_token
    assert d["tensor_parallel_size"] == 2
    assert d["kv_bytes_per_token"] == 2 * per_rank == config.kv_cache_bytes_per_token(
        torch.float32)
    assert [(e["batch"], e["label"]) for e in d["results"]] == [
        (1, "kvslim (2 tensor-parallel ranks)"), (2, "kvslim (2 tensor-parallel ranks)")]
    assert all(e["decode_tokens_per_s"] > 0 for e in d["results"])


def test_capacity_grows_with_fewer_kv_heads(hf_checkpoints, tmp_path):
    dirs = conversions(hf_checkpoints["mha8"], [2, 1], tmp_path, show_progress=False)
    r = run_capacity(dirs, kv_cache_memory=64 * 16384, context=32, show_progress=False)
    fit = [e.max_sequences for e in r.entries]
    assert [e.kv_heads for e in r.entries] == [8, 2, 1]
    assert fit == [fit[0], 4 * fit[0], 8 * fit[0]]
    assert r.entries[1].peak_running >= 3 * r.entries[0].peak_running


def test_capacity_of_latent_twins_equals_their_gqa_counts(hf_checkpoints, tmp_path):
    # each GQA count's MLA twin caches one latent row of the same bytes: the same blocks fit
    dirs = conversions(hf_checkpoints["mha8"], [2], tmp_path, show_progress=False, mla=True)
    r = run_capacity(dirs, kv_cache_memory=64 * 16384, context=32, show_progress=False)
    gqa, mla = r.entries[1], r.entries[2]
    assert mla.latent is not None and gqa.latent is None
    assert ModelConfig.from_dir(dirs[2]).architecture == "DeepseekV2ForCausalLM"
    assert mla.kv_bytes_per_token == gqa.kv_bytes_per_token < r.entries[0].kv_bytes_per_token
    assert (mla.num_blocks, mla.max_sequences) == (gqa.num_blocks, gqa.max_sequences)
    assert mla.peak_running >= 3 * r.entries[0].peak_running


def test_unknown_peer_is_an_error():
    with pytest.raises(KvslimError, match="unknown engine 'vllm'"):
        parse_compare("hf,vllm")


def test_cli_json(hf_checkpoints):
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "bench", "throughput",
                        "--model", str(hf_checkpoints["gqa"]), "--num-prompts", "3",
                        "--input-len", "8", "--output-len", "4", "--compare", "",
                        "--kv-cache-memory", "4MiB", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["results"][0]["engine"] == "kvslim"


def test_cli_rejects_zero_repeats(hf_checkpoints):
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "bench", "latency",
                        "--model", str(hf_checkpoints["gqa"]), "--repeats", "0", "--compare", ""],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--repeats must be at least 1" in r.stderr
    assert "Traceback" not in r.stderr


def test_profile_splits_the_decode_step(hf_checkpoints):
    from kvslim_lab.bench.profile import CATEGORIES, profile_decode
    r = profile_decode(hf_checkpoints["gqa"], batches=(1, 3), input_len=12, steps=4)
    assert [p.batch for p in r.profiles] == [1, 3]
    for p in r.profiles:
        assert set(p.ms_per_step) == set(CATEGORIES)
        assert p.ms_per_step["gemm"] > 0 and p.ms_per_step["attention"] > 0
        assert min(p.ms_per_step.values()) >= 0
        # the categories partition the profiled step (up to rounding)
        assert abs(sum(p.ms_per_step.values()) - p.profiled_step_ms) < 0.05 + 0.01 * p.steps
        assert p.top_ops and p.step_ms > 0
        assert p.op_calls >= 10              # every operator call of a step (dozens per layer)


def test_profile_cli_json_and_bad_steps(hf_checkpoints):
    base = [sys.executable, "-m", "kvslim.cli.main", "bench", "profile", "--model",
            str(hf_checkpoints["gqa"]), "--input-len", "8"]
    r = subprocess.run(base + ["--batches", "2", "--steps", "2", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["profiles"][0]["batch"] == 2
    bad = subprocess.run(base + ["--steps", "0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--steps" in bad.stderr and "Traceback" not in bad.stderr
