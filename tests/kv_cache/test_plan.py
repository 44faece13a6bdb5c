"""One KV-cache plan: computed from config.json alone (as the CLI checks flags), it is the plan
the engine runs with and what the runner allocates, to the byte; the draft model's cache
follows the target's; the planner's dtype names map onto the engine's through one table."""
import argparse

import pytest
import torch

from engine.engine_helpers import engine
from kvslim.attention import QUANTIZED_KV_DTYPES
from kvslim.cli.engine_args import check_args
from kvslim.cli.main import build_parser
from kvslim.engine.config import EngineConfig
from kvslim.errors import KvslimError
from kvslim.kv_cache.plan import ENGINE_KV_DTYPES, plan_kv_cache, size_kv_cache
from kvslim.kv_cache.groups import kv_cache_groups
from kvslim.models.config import ModelConfig
from kvslim.plan.memory import STORAGE_BITS, kv_bytes_per_token, plan_memory
from kvslim.plan.published import builtin_config

CASES = [("gqa", "auto"), ("gqa", "int8"), ("qwen3", "auto"), ("gemma3", "auto"),
         ("gemma3", "int8"), ("mixtral", "auto")]


@pytest.mark.parametrize("variant,kv_cache_dtype", CASES)
def test_the_plan_from_config_json_is_what_the_runner_allocates(hf_checkpoints, variant,
                                                                kv_cache_dtype):
    path = hf_checkpoints[variant]
    options = dict(kv_cache_memory=1_000_003, block_size=4, kv_cache_dtype=kv_cache_dtype,
                   max_num_batched_tokens=64)
    eng = engine(path, **options)
    kv_dtype = torch.int8 if kv_cache_dtype == "int8" else torch.float32
    planned = plan_kv_cache(ModelConfig.from_dir(path), kv_dtype,
                            EngineConfig(dtype="float32", device="cpu", **options))
    runner = eng.runner
    assert planned == eng.kv_plan == runner.kv_plan
    assert planned.max_model_len == eng.max_model_len
    assert planned.bytes_per_block == runner.kv_slot_bytes * planned.block_size   # allocated
    assert {t.shape[1] for t in runner.kv_cache} == {planned.num_blocks}
    assert eng.block_manager.num_blocks == planned.num_blocks
    assert eng.kv_cache_stats().max_tokens == planned.max_tokens
    assert [g.layers for g in planned.groups.groups] == [g.layers for g in runner.kv_groups.groups]


def test_the_draft_models_cache_follows_the_targets(hf_checkpoints):
    eng = engine(hf_checkpoints["gemma3"], block_size=4, kv_cache_memory="1MiB",
                 speculative=dict(method="draft", model=str(hf_checkpoints["gemma3"]),
                                  num_speculative_tokens=2))
    draft = eng.spec.draft.runner.kv_plan
    assert (draft.num_blocks, draft.max_model_len) == (eng.kv_plan.num_blocks,
                                                       eng.max_model_len)
    assert len(eng.kv_plan.groups.groups) > 1 and draft.windows == (None,)   # keeps every block
    assert eng.spec.draft.kv_cache_bytes == draft.num_blocks * draft.bytes_per_block


def test_sizes_the_cache_cannot_hold_are_errors(hf_checkpoints):
    config = ModelConfig.from_dir(hf_checkpoints["gqa"])
    with pytest.raises(KvslimError, match=r"^kv_cache_memory=1024 bytes is too small for one "
                                          r"block of 16 tokens \(4096 bytes for this model\)$"):
        plan_kv_cache(config, torch.float32, EngineConfig(kv_cache_memory=1024))
    with pytest.raises(KvslimError, match="max_model_len=100000 needs more KV cache than"):
        plan_kv_cache(config, torch.float32, EngineConfig(kv_cache_memory="64KiB",
                                                          max_model_len=100_000))
    assert size_kv_cache(kv_cache_groups(config), 16, 256, 1024).num_blocks == 0   # the planner


def test_the_cli_checks_max_model_len_before_loading(hf_checkpoints):
    args = build_parser().parse_args(["generate", "--model", str(hf_checkpoints["gqa"]),
                                      "--prompt", "x", "--kv-cache-memory", "64KiB",
                                      "--max-model-len", "100000"])
    with pytest.raises(KvslimError, match="max_model_len=100000 needs more KV cache than"):
        check_args(args)
    check_args(argparse.Namespace(**{**vars(args), "max_model_len": 64}))


@pytest.mark.parametrize("planner,engine_name", sorted(ENGINE_KV_DTYPES.items()))
def test_the_planners_kv_dtype_names_are_the_engines(planner, engine_name):
    assert set(ENGINE_KV_DTYPES.values()) == set(QUANTIZED_KV_DTYPES)
    assert STORAGE_BITS[planner] == 8 * QUANTIZED_KV_DTYPES[engine_name].itemsize
    config = builtin_config("Llama-3-8B")
    assert kv_bytes_per_token(config, planner) == config.kv_cache_bytes_per_token(engine_name)
    assert plan_memory(config, kv_dtype=planner).kv_bytes_per_token == \
        config.kv_cache_bytes_per_token(engine_name)
