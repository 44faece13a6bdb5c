"""Engine options declared once (EngineConfig's fields): `LLM(model, **options)` passes them in
and names the close matches of an unknown one; the CLI's flags are generated from the fields
and reach the config unchanged."""
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from kvslim import LLM
from kvslim.cli.engine_args import engine_config_from_args, flag_fields, flag_of
from kvslim.cli.main import build_parser
from kvslim.engine.config import EngineConfig
from kvslim.errors import KvslimError


def test_an_unknown_keyword_names_the_close_match():
    with pytest.raises(KvslimError) as e:
        LLM("no-such-model", kv_cache_memroy="1GiB")     # refused before the model resolves
    assert str(e.value) == ("unknown engine option 'kv_cache_memroy'; did you mean "
                            "kv_cache_memory or kv_cache_dtype or kv_offload_memory?")
    with pytest.raises(KvslimError, match=r"^unknown engine option 'colour' \(options: dtype, "):
        EngineConfig.from_options(colour="blue")
    assert EngineConfig.from_options(block_size=8) == EngineConfig(block_size=8)


# A per-layer KV plan (kv_cache/layer_plan.py) of two layers: the flag reads the file.
KV_PLAN = Path(__file__).parent / "kv_plan_two_layers.json"

NON_DEFAULT = {
    "--dtype": "bfloat16", "--device": "cpu", "--kv-cache-dtype": "int8",
    "--kv-cache-memory": "3MiB", "--block-size": "8", "--max-num-seqs": "3",
    "--max-num-batched-tokens": "64", "--max-model-len": "100", "--no-prefix-caching": None,
    "--enforce-eager": None, "--compile": None, "--attention-backend": "flex", "--linear-activations": "float32",
    "--keep-out-of-window-blocks": None, "--cuda-sparse-24": None,
    "--speculative-config": '{"method": "ngram", "num_speculative_tokens": 2}',
    "--tensor-parallel-size": "1", "--tensor-parallel-oversubscribe": None,
    "--distributed-timeout": "5.5", "--kv-window": "64", "--kv-sink-tokens": "4", "--kv-hadamard": None,
    "--max-loras": "3", "--max-lora-rank": "32", "--max-cpu-loras": "5",
    "--kv-offload-max-bytes": "3MiB", "--kv-offload-write-through": None,
}
# Flags that cannot join the others (LoRA adapters refuse speculative decoding, the offload
# tier needs prefix caching, demotion a float32 cache): each in its own run, flag -> (its value or None, the config).
APART = {"--enable-lora": (None, dict(enable_lora=True)),
         "--kv-offload-dir": ("d", dict(kv_offload_dir="d")),
         "--kv-offload-memory": ("2MiB", dict(kv_offload_memory="2MiB")),
         "--kv-plan": (str(KV_PLAN), dict(kv_plan=str(KV_PLAN))),
         "--kv-pressure": ("demote", dict(kv_pressure="demote"))}


def test_every_generated_flag_round_trips_to_the_config():
    assert set(NON_DEFAULT) | set(APART) == {flag_of(f) for f in flag_fields()}  # one per option
    argv = [x for flag, value in NON_DEFAULT.items() for x in (flag, value) if x is not None]
    config = engine_config_from_args(build_parser().parse_args(["serve", "m", *argv]))
    expected = EngineConfig(
        dtype="bfloat16", device="cpu", kv_cache_dtype="int8", kv_cache_memory=3 * 2**20,
        block_size=8, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=100,
        enable_prefix_caching=False, enforce_eager=True, compile_decode=True,
        attention_backend="flex", linear_activations="float32",
        keep_out_of_window_blocks=True, cuda_sparse_24=True, speculative={"method": "ngram",
                                                     "num_speculative_tokens": 2},
        tensor_parallel_oversubscribe=True, distributed_timeout=5.5, kv_window=64,
        kv_sink_tokens=4, kv_hadamard=True, max_loras=3, max_lora_rank=32, max_cpu_loras=5,
        kv_offload_max_bytes="3MiB", kv_offload_write_through=True)
    assert asdict(config) == asdict(expected)
    changed = {f.name for f in fields(EngineConfig)
               if getattr(config, f.name) != getattr(EngineConfig(), f.name)}
    apart = {name for _, options in APART.values() for name in options}
    assert changed == {f.name for f in flag_fields()} - {"tensor_parallel_size"} - apart
    for flag, (value, options) in APART.items():
        argv = ["serve", "m", flag] + ([value] if value is not None else [])
        assert engine_config_from_args(build_parser().parse_args(argv)) == EngineConfig(**options)


def test_flags_default_to_the_fields_or_the_commands_own():
    serve = engine_config_from_args(build_parser().parse_args(["serve", "m"]))
    assert serve == EngineConfig()
    generate = engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert generate == EngineConfig(kv_cache_memory="256MiB", max_num_seqs=8)


def test_a_bad_choice_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--kv-cache-dtype", "fp8"])
