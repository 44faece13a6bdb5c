"""`kvslim plan-kv` as a user runs it: a budget that holds the float cache keeps every layer
exact (KL 0); a tighter one spends fewer bytes on the layers that lose least and fits; a budget
below the cheapest plan is one line and exit 2."""
import json
import subprocess
import sys


def plan_kv(ckpt, calib, memory, *extra):
    return subprocess.run([sys.executable, "-m", "kvslim.cli.main", "plan-kv", str(ckpt),
                           "--kv-memory", memory, "--context", "128", "--concurrency", "2",
                           "--windows", "32", "--calibration", str(calib), "--tokens", "64",
                           "--batches", "1", "--json", *extra],
                          capture_output=True, text=True, timeout=600)


def test_plans_fit_their_budget_by_measured_loss(hf_checkpoints, calib_file, tmp_path):
    ckpt = hf_checkpoints["gqa"]
    roomy = plan_kv(ckpt, calib_file, "64MiB")
    assert roomy.returncode == 0, roomy.stderr
    plan = json.loads(roomy.stdout)
    assert all(l == {"precision": "auto", "window": None} for l in plan["layers"])
    assert plan["predicted_kl"] == 0 and abs(plan["measured_kl"]) < 1e-6
    full = plan["bytes_per_sequence"]
    tight = plan_kv(ckpt, calib_file, str(full), "--out", str(tmp_path / "plan.json"))
    assert tight.returncode == 0, tight.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["bytes_per_sequence"] <= full // 2
    assert any(l != {"precision": "auto", "window": None} for l in plan["layers"])
    assert plan["measured_kl"] > 0 and plan["predicted_kl"] > 0


def test_a_budget_below_the_cheapest_plan_is_one_line(hf_checkpoints, calib_file):
    r = plan_kv(hf_checkpoints["gqa"], calib_file, "1KiB")
    assert r.returncode == 2 and "below the cheapest plan" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0


def test_by_default_it_calibrates_at_the_context_with_its_windows(hf_checkpoints, calib_file):
    from kvslim.kv_cache.budget import KVSetting, sequence_bytes
    from kvslim.models.config import ModelConfig
    config = ModelConfig.from_dir(hf_checkpoints["gqa"])
    int2 = sum(sequence_bytes(config, l, KVSetting("int2"), "int2", 512, 4, 16)
               for l in range(config.num_hidden_layers))
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "plan-kv",     # below int2
                        str(hf_checkpoints["gqa"]), "--kv-memory", str(int2 - 1), "--context", "512",
                        "--calibration", str(calib_file), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    windows = {l["window"] for l in plan["layers"]} - {None}
    assert windows and windows <= {32, 128, 256, 384}      # 1/16, 1/4, 1/2, 3/4 of 512
    assert plan["max_tokens"] > 0 and "engine_error" not in plan
