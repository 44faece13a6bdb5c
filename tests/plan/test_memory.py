"""The memory planner: the issue's acceptance figures, the built-in table against published
parameter counts, planner == engine allocation on every test checkpoint, and the CLI."""
import json
import subprocess
import sys

import pytest
from checkpoints import VARIANTS
from kvslim.plan.memory import format_bytes, kv_capacity, plan_memory, storage_bytes
from kvslim.plan.parameters import parameter_counts
from kvslim.plan.published import builtin_names
from kvslim.plan.published import builtin_config as builtin_spec
from kvslim.cli.main import main
from kvslim.cli.memory_cmds import resolve_model_config as resolve_spec
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig
from kvslim.formats.info import count_parameters

# Totals as published with each checkpoint (safetensors metadata / model card), not from kvslim.
PUBLISHED_PARAMETERS = {
    "Llama-2-7B": 6_738_415_616, "Llama-2-13B": 13_015_864_320, "Llama-2-70B": 68_976_648_192,
    "Llama-3-8B": 8_030_261_248, "Llama-3-70B": 70_553_706_496, "Mistral-7B": 7_241_732_096,
    "Mixtral-8x7B": 46_702_792_704, "Qwen2-7B": 7_615_616_512, "SmolLM2-135M": 134_515_008,
}


def gb(n: int) -> float:
    return n / 1e9


def test_llama2_70b_acceptance_figures():
    spec = builtin_spec("Llama-2-70B")
    assert (spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim) == (80, 8, 128)
    plan = plan_memory(spec, context=4096, batch=1, dtype="fp16", kv_dtype="fp16")
    assert plan.kv_bytes_per_token == 327_680
    assert plan.layout("GQA").kv_elements_per_token == 163_840     # 2 * 80 * 8 * 128
    assert plan.layout("MHA").kv_bytes_per_token == 2_621_440
    assert plan.layout("MQA").kv_bytes_per_token == 40_960
    assert plan.kv_bytes == 1_342_177_280 and plan.layout("MHA").kv_bytes == 10_737_418_240
    assert (f"{gb(plan.kv_bytes):.2f}", f"{gb(plan.layout('MHA').kv_bytes):.1f}") == ("1.34", "10.7")
    plan = plan_memory(spec, context=2048, batch=1, dtype="fp16", kv_dtype="fp16")
    assert (f"{gb(plan.kv_bytes):.2f}", f"{gb(plan.layout('MHA').kv_bytes):.2f}") == ("0.67", "5.37")


def test_llama2_70b_cli_text(capsys):
    assert main(["memory", "Llama-2-70B", "--context", "4096", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "327,680 B" in out and "= 163,840 elements" in out and "2,621,440" in out
    assert "1.34 GB (1.25 GiB)" in out and "10.7 GB (10.0 GiB)" in out
    assert "GB = 10^9 bytes, GiB = 2^30 bytes" in out
    assert "| 2,048 | 5.37 GB | 671 MB | 83.9 MB |" in out       # the markdown table


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_builtin_parameter_counts_match_published(name):
    assert parameter_counts(builtin_spec(name))[0] == PUBLISHED_PARAMETERS[name]


def test_moe_and_mla_counts():
    total, active = parameter_counts(builtin_spec("Mixtral-8x7B"))
    assert active == 12_879_925_248                          # "12.9B active" (2 of 8 experts)
    total, active = parameter_counts(builtin_spec("DeepSeek-V2"))
    assert round(total / 1e9) == 236 and round(active / 1e9) == 21   # "236B total, 21B active"


def test_kv_per_token_of_every_builtin():
    expected = {}
    for name in builtin_names():
        s = builtin_spec(name)
        expected[name] = 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * 2
    expected["DeepSeek-V2"] = 60 * (512 + 64) * 2             # MLA: latent + RoPE key, bf16
    for name, value in expected.items():
        assert plan_memory(builtin_spec(name), kv_dtype="bf16").kv_bytes_per_token == value, name


def test_kv_dtypes():
    spec = builtin_spec("Llama-2-70B")
    sizes = {d: plan_memory(spec, kv_dtype=d).kv_bytes_per_token
             for d in ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2")}
    scales = 80 * 2 * 8 * 2              # a float16 scale per token, layer, K/V and KV head
    # Packed, in blocks of 64: per layer and KV head, the keys' float16 scale and minimum per
    # channel over the block (2 * 2 * 128 / 64 bytes a token) and the values' per token and
    # group of 64 channels (2 groups * 2 * 2 bytes).
    packed = 80 * 8 * (2 * 2 * 128 // 64 + 2 * 2 * 2)
    assert sizes == {"fp32": 655_360, "fp16": 327_680, "bf16": 327_680, "fp8": 163_840 + scales,
                     "int8": 163_840 + scales, "int4": 81_920 + packed,
                     "int2": 40_960 + packed}
    assert plan_memory(spec, dtype="int4").kv_dtype == "fp16"     # quantized weights: 16-bit KV
    assert plan_memory(spec, dtype="int4").weight_bytes == 68_976_648_192 // 2
    assert storage_bytes(3, "int4") == 2


def test_capacity_in_whole_blocks():
    cap = kv_capacity(kv_budget_bytes=100_000, bytes_per_token=300, block_size=16, context=40)
    assert (cap.bytes_per_block, cap.num_blocks, cap.max_tokens, cap.max_sequences) == \
        (4800, 20, 320, 6)                                   # 40 tokens hold 3 blocks
    assert kv_capacity(-5, 300, 16, 40).num_blocks == 0


def test_memory_budget_and_gqa_multiplier():
    plan = plan_memory(builtin_spec("Llama-3-8B"), context=8192, batch=8, memory_bytes=24 * 2**30)
    assert plan.free_bytes == 24 * 2**30 - plan.weight_bytes
    mha, gqa = plan.layout("MHA").capacity, plan.layout("GQA").capacity
    assert gqa.num_blocks == plan.free_bytes // (16 * 131_072)
    assert gqa.num_blocks // 4 <= mha.num_blocks <= gqa.num_blocks // 4 + 1   # G = 4
    tight = plan_memory(builtin_spec("Llama-2-70B"), memory_bytes=80 * 10**9)
    assert tight.layout("GQA").capacity.max_tokens == 0
    assert any("weights alone exceed" in note for note in tight.notes)


# DeepSeek's MLA included: the engine caches the latent rows the planner prices
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_planner_equals_engine_allocation(hf_checkpoints, variant, dtype):
    model_dir = hf_checkpoints[variant]
    budget = 1_000_003                                       # not a whole number of blocks
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_memory=budget, dtype=dtype, device="cpu",
                                               max_num_seqs=4))
    spec = resolve_spec(str(model_dir))
    weights = storage_bytes(parameter_counts(spec)[0], "fp32")     # stored as float32
    plan = plan_memory(spec, context=100, kv_dtype=dtype, memory_bytes=budget + weights)
    runner, stats = engine.runner, engine.kv_cache_stats()
    groups = len(runner.kv_groups.groups)          # a block holds one group's layers
    assert runner.bytes_per_block % runner.block_size == 0
    assert plan.kv_bytes_per_token == runner.bytes_per_block * groups // runner.block_size
    assert plan.kv_bytes_per_token == runner.kv_slot_bytes * groups == stats.bytes_per_token
    assert [g.bytes_per_token for g in plan.kv_groups] == [runner.kv_slot_bytes] * groups
    own = plan.layout(spec.attention_kind).capacity
    assert (own.num_blocks, own.max_tokens) == (runner.num_blocks, stats.max_tokens)
    assert parameter_counts(spec)[0] == count_parameters(model_dir, ModelConfig.from_dir(model_dir))


def test_model_inputs(hf_checkpoints):
    gqa = hf_checkpoints["gqa"]
    assert resolve_spec(str(gqa)).num_key_value_heads == 2
    assert resolve_spec(str(gqa / "config.json")).num_key_value_heads == 2
    assert resolve_spec("llama-2-70b").name == "Llama-2-70B"
    assert resolve_spec("meta-llama/Meta-Llama-3-8B").name == "Llama-3-8B"
    with pytest.raises(KvslimError, match="unknown model 'Llama-5'"):
        resolve_spec("Llama-5")


def test_format_bytes():
    assert format_bytes(1_342_177_280) == "1.34 GB"
    assert format_bytes(1_342_177_280, binary=True) == "1.25 GiB"
    assert format_bytes(999) == "999 B" and format_bytes(327_680) == "328 kB"


def test_cli_json_and_plot(tmp_path, capsys):
    png = tmp_path / "kv.png"
    assert main(["memory", "Mistral-7B", "--context", "32768", "--memory", "24GiB", "--json",
                 "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 131_072 and data["memory_bytes"] == 24 * 2**30
    assert [lp["name"] for lp in data["layouts"]] == ["MHA", "GQA", "MQA"]
    assert data["layouts"][1]["capacity"]["max_sequences"] >= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("sliding window 4,096" in note for note in data["notes"])
    assert main(["memory", "--list"]) == 0
    assert "DeepSeek-V2" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["No-Such-Model"], "unknown model 'No-Such-Model'"),
    (["Llama-2-70B", "--kv-dtype", "int3"], "--kv-dtype: unknown dtype 'int3'"),
    (["Llama-2-70B", "--context", "0"], "--context must be a positive integer, got 0"),
    (["Llama-2-70B", "--context", "-4096"], "--context must be a positive integer"),
    (["Llama-2-70B", "--memory", "lots"], "cannot parse memory size 'lots'"),
])
def test_bad_input_is_one_line_error(args, message, capsys):
    assert main(["memory", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_bad_input_from_the_shell_has_no_traceback():
    result = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "memory", "Llama-2-70B",
                             "--kv-dtype", "int3"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("variant", ["gqa", "mqa", "head_dim"])
def test_planner_equals_engine_allocation_with_int8_kv(hf_checkpoints, variant):
    """`kvslim memory --kv-dtype int8` and an engine with kv_cache_dtype="int8": the same bytes
    per token (int8 elements + float16 scales) and the same blocks for a budget, to the byte."""
    model_dir = hf_checkpoints[variant]
    budget = 1_000_003
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_memory=budget, dtype="float32",
                                               device="cpu", max_num_seqs=4,
                                               kv_cache_dtype="int8"))
    spec = resolve_spec(str(model_dir))
    weights = storage_bytes(parameter_counts(spec)[0], "fp32")
    plan = plan_memory(spec, context=100, kv_dtype="int8", memory_bytes=budget + weights)
    runner, stats = engine.runner, engine.kv_cache_stats()
    stored = runner.kv_slot_bytes
    assert plan.kv_bytes_per_token == runner.bytes_per_block // runner.block_size == stored
    assert plan.kv_bytes_per_token == stats.bytes_per_token
    own = plan.layout(spec.attention_kind).capacity
    assert (own.num_blocks, own.max_tokens) == (runner.num_blocks, stats.max_tokens)
    assert stats.kv_cache_dtype == "int8"


def test_memory_per_rank_with_tensor_parallelism(capsys):
    """Llama-3-8B (32 query, 8 KV heads): 2 ranks split the KV heads, 16 ranks replicate them
    (one per rank, each head on 2 ranks), so the per-rank cache stops shrinking at 8."""
    def per_rank(n):
        assert main(["memory", "Llama-3-8B", "--tensor-parallel-size", str(n), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        return data["kv_bytes_per_token"], data["tensor_parallel"]
    full, two = per_rank(2)
    _, eight = per_rank(8)
    _, sixteen = per_rank(16)
    assert two["kv_bytes_per_token"] == full // 2 and not two["replicated"]
    assert eight["kv_bytes_per_token"] == sixteen["kv_bytes_per_token"] == full // 8
    assert sixteen["replicated"] and set(sixteen["kv_replicas_per_layer"]) == {2}
    assert sixteen["weight_bytes"] < eight["weight_bytes"] < two["weight_bytes"]
    bad = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "memory", "Llama-3-8B",
                          "--tensor-parallel-size", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "cannot split 32 query heads" in bad.stderr
