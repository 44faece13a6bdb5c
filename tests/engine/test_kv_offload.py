"""The KV offload tier in the engine: a prefix the pool evicted comes back from host memory or
disk (counted as cached tokens) with the same greedy tokens as computing it; a restart finds
it on disk; damaged files and another model's files never change an answer; no block leaks."""
import pytest

from engine_helpers import GREEDY, engine, prompts_of, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError

PARAMS = SamplingParams(max_tokens=6, **GREEDY)
PROMPT = prompts_of([45], seed=21)[0]
FILLERS = prompts_of([40] * 6, seed=22)


def tiered(path, **tier):
    return engine(path, block_size=4, kv_cache_memory="40KiB", **tier)


def cached_tokens(out) -> int:
    return out.metrics.num_cached_tokens


def after_eviction(eng):
    """PROMPT, then enough other prompts to push its blocks out of the pool, then PROMPT again."""
    first = run(eng, [PROMPT], PARAMS)[0]
    for filler in FILLERS:
        run(eng, [filler], PARAMS)
    return first, run(eng, [PROMPT], PARAMS)[0]


@pytest.mark.parametrize("tier", ["disk", "memory", "both"])
def test_an_evicted_prefix_comes_back_from_the_tier(hf_checkpoints, tmp_path, tier):
    ckpt = hf_checkpoints["gqa"]
    options = {"disk": dict(kv_offload_dir=str(tmp_path)), "memory": dict(kv_offload_memory="4MiB"),
               "both": dict(kv_offload_dir=str(tmp_path), kv_offload_memory="64KiB")}[tier]
    plain_first, plain_again = after_eviction(tiered(ckpt))
    assert cached_tokens(plain_again) == 0                  # the pool alone lost it
    eng = tiered(ckpt, **options)
    first, again = after_eviction(eng)
    assert cached_tokens(again) == 44                       # all but the last prompt token's block
    assert tokens([first, again]) == tokens([plain_first, plain_again])
    assert eng.block_manager.offload.tier.stats.hits == 11


def test_a_restart_finds_the_prefix_on_disk(hf_checkpoints, tmp_path):
    ckpt = hf_checkpoints["gqa"]
    plain = tokens(run(tiered(ckpt), [PROMPT], PARAMS))
    writer = tiered(ckpt, kv_offload_dir=str(tmp_path), kv_offload_write_through=True)
    assert tokens(run(writer, [PROMPT], PARAMS)) == plain
    reader = tiered(ckpt, kv_offload_dir=str(tmp_path))
    out = run(reader, [PROMPT], PARAMS)[0]
    assert cached_tokens(out) == 44 and tokens([out]) == plain


def test_damaged_files_are_dropped_and_change_nothing(hf_checkpoints, tmp_path):
    ckpt = hf_checkpoints["gqa"]
    plain = tokens(run(tiered(ckpt), [PROMPT], PARAMS))
    run(tiered(ckpt, kv_offload_dir=str(tmp_path), kv_offload_write_through=True), [PROMPT],
        PARAMS)
    files = sorted(tmp_path.glob("*.kvblock"))
    assert len(files) == 12                  # the prompt's 11 full blocks, one more with the answer
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        data[(97 * i) % len(data)] ^= 0x01                  # one bit, somewhere in each
        path.write_bytes(bytes(data))
    reader = tiered(ckpt, kv_offload_dir=str(tmp_path))
    out = run(reader, [PROMPT], PARAMS)[0]
    assert tokens([out]) == plain and cached_tokens(out) == 0
    assert reader.block_manager.offload.tier.stats.rejected == 1     # the lookup stops there


def test_another_models_files_are_never_read(hf_checkpoints, tmp_path):
    run(tiered(hf_checkpoints["gqa"], kv_offload_dir=str(tmp_path),
               kv_offload_write_through=True), [PROMPT], PARAMS)
    other = tiered(hf_checkpoints["mqa"], kv_offload_dir=str(tmp_path))
    out = run(other, [PROMPT], PARAMS)[0]
    assert cached_tokens(out) == 0
    assert tokens([out]) == tokens(run(tiered(hf_checkpoints["mqa"]), [PROMPT], PARAMS))


@pytest.mark.parametrize("options, match", [
    (dict(kv_offload_dir="x", enable_prefix_caching=False), "needs prefix caching on"),
    (dict(kv_offload_memory="1GiB", tensor_parallel_size=2), "tensor_parallel_size > 1")])
def test_options_the_tier_cannot_run_with_are_refused(options, match):
    from kvslim.engine.config import EngineConfig
    with pytest.raises(KvslimError, match=match):
        EngineConfig(**options)


def test_preemption_under_a_full_pool_leaks_nothing(hf_checkpoints, tmp_path):
    """More sequences than the pool holds at once (preemption, recompute) with a bounded disk
    tier: the same tokens as without the tier, no block left in use, the tier within its bound."""
    ckpt = hf_checkpoints["gqa"]
    prompts = prompts_of([30, 41, 25, 37, 33, 28], seed=23, prefix=PROMPT[:16])
    params = SamplingParams(max_tokens=14, **GREEDY)
    plain = tokens(run(tiered(ckpt), prompts, params))
    eng = tiered(ckpt, kv_offload_dir=str(tmp_path), kv_offload_max_bytes="24KiB")
    assert tokens(run(eng, prompts, params)) == plain          # run() checks no block is used
    assert eng.scheduler.num_preemptions > 0
    tier = eng.block_manager.offload.tier
    assert tier.disk_used == sum(tier.files.values()) <= 24 * 1024
    assert sorted(p.name[:-8] for p in tmp_path.glob("*.kvblock")) == sorted(tier.files)


def test_smollm2_answers_the_same_after_a_restart(smollm2_dir, tmp_path):
    from kvslim.engine.config import EngineConfig
    from kvslim.engine.llm_engine import LLMEngine
    text = "The KV cache, not the weights, is what stops long prompts on small machines. " * 12

    def smol(**tier):
        return LLMEngine(smollm2_dir, EngineConfig(dtype="float32", device="cpu",
                                                   kv_cache_memory="64MiB", **tier))
    params = SamplingParams(max_tokens=8, **GREEDY)
    plain = tokens(run(smol(), [text], params))
    run(smol(kv_offload_dir=str(tmp_path), kv_offload_write_through=True), [text], params)
    out = run(smol(kv_offload_dir=str(tmp_path)), [text], params)[0]
    assert tokens([out]) == plain and cached_tokens(out) > 100


def test_cut_requests_leave_no_block_in_use(hf_checkpoints, tmp_path):
    """Requests aborted mid-prefill and mid-decode (a client gone) with the tier on: every
    block back in the pool, and what the tier holds still serves an identical answer."""
    ckpt = hf_checkpoints["gqa"]
    eng = tiered(ckpt, kv_offload_dir=str(tmp_path), kv_offload_write_through=True,
                 max_num_batched_tokens=16)
    ids = [eng.add_request(p, SamplingParams(max_tokens=30, **GREEDY))
           for p in [PROMPT] + FILLERS[:3]]
    for steps in range(6):
        eng.step()
        if steps in (1, 4):
            eng.abort_request(ids.pop(0))
    for request_id in ids:
        eng.abort_request(request_id)
    assert eng.kv_cache_stats().num_used_blocks == 0 and not eng.has_unfinished_requests()
    plain = tokens(run(tiered(ckpt), [PROMPT], PARAMS))
    assert tokens(run(tiered(ckpt, kv_offload_dir=str(tmp_path)), [PROMPT], PARAMS)) == plain


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_comes_back_with_its_scales(hf_checkpoints, tmp_path, kv_cache_dtype):
    ckpt = hf_checkpoints["gqa"]
    plain = after_eviction(tiered(ckpt, kv_cache_dtype=kv_cache_dtype))
    first, again = after_eviction(tiered(ckpt, kv_cache_dtype=kv_cache_dtype,
                                         kv_offload_dir=str(tmp_path)))
    assert cached_tokens(again) == 44 and tokens([first, again]) == tokens(plain)
