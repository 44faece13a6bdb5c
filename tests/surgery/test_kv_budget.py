"""Per-layer KV-head budgets: the allocator (exact budget, optimal, the sensitive layer gets more
heads), the per-layer sensitivity it is fed, `kvslim convert --kv-budget` end to end, and its
errors."""
import itertools
import json
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from checkpoints import VOCAB
from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model
from kvslim.models.config import ModelConfig
from kvslim.surgery.convert import convert_to_budget, convert_to_gqa
from kvslim.surgery.kv_budget import allocate, candidate_heads, heads_budget, uniform_allocation
from kvslim.surgery.sensitivity import expand_heads

IDS = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(3))


def test_candidates_are_the_divisors():
    assert candidate_heads(8) == [8, 4, 2, 1]
    assert candidate_heads(3) == [3, 1]
    assert candidate_heads(1) == [1]


costs_strategy = st.lists(
    st.fixed_dictionaries({8: st.just(0.0), 4: st.floats(0, 1), 2: st.floats(0, 2),
                           1: st.floats(0, 4)}), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(costs_strategy, st.integers(0, 40))
def test_allocation_respects_the_budget_and_is_optimal(costs, budget):
    if budget < len(costs):
        with pytest.raises(KvslimError, match="cannot give each"):
            allocate(costs, budget)
        return
    picks = allocate(costs, budget)
    combos = [combo for combo in itertools.product(*[list(c) for c in costs])
              if sum(combo) <= budget]
    most = max(map(sum, combos))
    assert sum(picks) == most                # the whole budget, where any choice sums to it
    best = min(sum(c[k] for c, k in zip(costs, combo)) for combo in combos if sum(combo) == most)
    assert sum(c[k] for c, k in zip(costs, picks)) == pytest.approx(best)


def test_the_budget_is_spent_even_where_a_count_measured_cheaper():
    noisy = {4: 0.0, 2: 0.3, 1: 0.2}                       # K=1 measured below K=2
    assert allocate([noisy, noisy], 4) == [2, 2]             # not [1, 2], 0.5 < 0.6
    assert sorted(allocate([noisy, noisy, noisy], 7)) == [1, 2, 4]
    assert allocate([{8: 0.0, 4: 1.0}, {8: 0.0, 4: 1.0}], 11) == [4, 4]   # 11 unreachable

    flat = {8: 0.0, 4: 0.1, 2: 0.2, 1: 0.3}
    sensitive = {8: 0.0, 4: 1.0, 2: 5.0, 1: 9.0}
    assert allocate([flat, sensitive, flat, flat], 12) == [2, 8, 1, 1]
    assert sorted(allocate([flat, flat, flat, flat], 12)) == [2, 2, 4, 4]   # convex: spread


def test_budget_in_heads(hf_checkpoints):
    config = ModelConfig.from_dir(hf_checkpoints["mha8"])     # 2 layers x 8 heads, float32
    assert heads_budget(config, 0.25) == 4
    assert heads_budget(config, 1.0) == 16
    per_head = 2 * config.head_dim * 4
    assert heads_budget(config, bytes_per_token=5 * per_head + 3) == 5
    assert uniform_allocation(config, 5) == [2, 2]


@pytest.mark.parametrize("kwargs,message", [
    (dict(fraction=0.1), "leaves 1 KV heads for 2 layers; every layer needs at least one"),
    (dict(fraction=1.5), "must be in \\(0, 1\\]"),
    (dict(fraction=0.0), "must be in \\(0, 1\\]"),
    (dict(bytes_per_token=10 ** 9), "above the source's"),
    (dict(bytes_per_token=10), "leaves 0 KV heads for 2 layers"),
    (dict(), "give one of --kv-budget"),
])
def test_bad_budgets(hf_checkpoints, kwargs, message):
    with pytest.raises(KvslimError, match=message):
        heads_budget(ModelConfig.from_dir(hf_checkpoints["mha8"]), **kwargs)


def test_expanded_heads_compute_what_the_pooled_layer_computes(hf_checkpoints, tmp_path):
    """The sensitivity probe runs a K-head layer inside the source's shapes."""
    src = hf_checkpoints["mha8"]
    pooled = convert_to_gqa(src, tmp_path / "k2", 2, "mean", show_progress=False)
    state = load_file(pooled / "model.safetensors")
    prefix = "model.layers.1.self_attn."
    expanded = expand_heads({n: state[prefix + n] for n in ("k_proj.weight", "v_proj.weight")},
                            2, 8, ModelConfig.from_dir(src).head_dim)
    model = load_model(src, dtype=torch.float32)
    model.load_weights({prefix + n: t for n, t in expanded.items()}.items())
    both = convert_to_gqa(src, tmp_path / "mixed", [8, 2], "mean", show_progress=False)
    assert torch.allclose(model.logits(IDS), load_model(both).logits(IDS), atol=1e-5)


def make_one_layer_sensitive(src, dst):
    """Layer 0's KV heads all equal (merging them loses nothing), layer 1's made 4x larger."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    d = ModelConfig.from_dir(src).head_dim
    for proj in ("k_proj", "v_proj"):
        w = state[f"model.layers.0.self_attn.{proj}.weight"]
        state[f"model.layers.0.self_attn.{proj}.weight"] = w[:d].repeat(w.shape[0] // d, 1)
        state[f"model.layers.1.self_attn.{proj}.weight"] *= 4
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("method", ["mean", "align"])
def test_sensitivity_allocation_end_to_end(hf_checkpoints, calib_file, tmp_path, method):
    src = make_one_layer_sensitive(hf_checkpoints["mha8"], tmp_path / "src")
    out = convert_to_budget(src, tmp_path / "nu", "sensitivity", 0.3125, method=method,
                            calib=calib_file, calib_samples=2, calib_seq_len=32,
                            sensitivity_samples=2, show_progress=False)
    config = ModelConfig.from_dir(out)
    assert config.kv_heads_per_layer == (1, 4)              # 5 of 16 heads, to the byte
    assert config.kv_bytes_per_token("float32") == 5 * 2 * config.head_dim * 4
    record = json.loads((out / "kv_allocation.json").read_text())
    assert record["kv_heads"] == [1, 4] and record["budget_kv_heads"] == 5
    assert record["layer_kl"][0]["1"] == pytest.approx(0.0, abs=1e-6)
    assert record["layer_kl"][1]["1"] > 0.01
    uniform = convert_to_budget(src, tmp_path / "u", "uniform", 0.3125, method="mean",
                                show_progress=False)
    assert ModelConfig.from_dir(uniform).kv_heads_per_layer == (2, 2)
    assert ModelConfig.from_dir(uniform).layer_kv_heads is None      # a plain HF config


def test_cli_budget_errors_are_one_line(hf_checkpoints, tmp_path, calib_file):
    base = [sys.executable, "-m", "kvslim.cli.main", "convert", str(hf_checkpoints["mha8"]),
            str(tmp_path / "o")]
    for extra, message in ((["--kv-budget", "0.05", "--calib", str(calib_file)],
                            "every layer needs at least one"),
                           (["--kv-budget", "2"], "(0, 1]"),
                           (["--kv-budget", "0.5", "--allocate", "sensitivity"], "--calib")):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        assert r.returncode != 0
        assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
        assert not (tmp_path / "o").exists()


def test_cli_budget_conversion_json(hf_checkpoints, tmp_path, calib_file, capsys):
    from kvslim.cli.main import main
    src = make_one_layer_sensitive(hf_checkpoints["mha8"], tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "o"), "--kv-budget", "0.3125",
                 "--method", "mean", "--calib", str(calib_file), "--calib-seq-len", "32",
                 "--sensitivity-samples", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_heads"] == [1, 4] and out["allocation"] == "sensitivity"
    assert out["kv_bytes_per_token"] == 5 * 2 * 8 * 4
    assert main(["info", str(tmp_path / "o")]) == 0
    assert "KV heads / layer  1 4" in capsys.readouterr().out
