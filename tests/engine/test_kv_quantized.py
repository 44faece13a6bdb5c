"""The engine with an int8 (and fp8) KV cache: greedy output independent of batch composition,
chunking, preemption and prefix caching; logits near the float cache's; more blocks for the same
budget; no leaked blocks; the padded decode-graph path."""
import pytest
import torch

from checkpoints import VOCAB
from engine_helpers import GREEDY, engine, prompts_of, run, tokens
from kvslim.engine.config import EngineConfig
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError

LENGTHS = [3, 17, 40, 5, 33, 64, 1, 20, 9]
PARAMS = SamplingParams(max_tokens=16, **GREEDY)
SHARED = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(9)).tolist()



@pytest.fixture(scope="module", params=["gqa", "mqa", "head_dim"])
def path(request, hf_checkpoints):
    return hf_checkpoints[request.param]


def test_int8_greedy_is_independent_of_batch_chunks_and_prefix_cache(path):
    prompts = prompts_of(LENGTHS) + prompts_of([4, 11, 7], seed=1, prefix=SHARED)
    alone = [tokens(run(engine(path, kv_cache_dtype="int8"), [p], PARAMS))[0] for p in prompts]
    assert tokens(run(engine(path, kv_cache_dtype="int8"), prompts, PARAMS)) == alone
    chunked = engine(path, kv_cache_dtype="int8", max_num_batched_tokens=16)
    assert tokens(run(chunked, prompts, PARAMS)) == alone
    small = engine(path, kv_cache_memory="64KiB", kv_cache_dtype="int8").runner.bytes_per_block
    tight = engine(path, kv_cache_memory=12 * small, block_size=8, kv_cache_dtype="int8")
    assert tokens(run(tight, prompts, PARAMS)) == alone
    assert tight.kv_cache_stats().num_preemptions > 0
    cached = engine(path, block_size=8, kv_cache_dtype="int8")
    first = run(cached, prompts[-3:-2], PARAMS)
    rest = run(cached, prompts[-2:], PARAMS)                      # 48 prefix tokens hit
    assert all(o.metrics.num_cached_tokens == 48 for o in rest)
    assert tokens(first + rest) == alone[-3:]
    off = engine(path, block_size=8, kv_cache_dtype="int8", enable_prefix_caching=False)
    assert tokens(run(off, prompts[-3:], PARAMS)) == alone[-3:]


def test_int8_logprobs_are_near_float_logprobs(path):
    """Bound on the tiny random models (logprobs around -6): every prompt token's logprob within
    0.1 of the float cache's, 0.03 on average (measured: up to 0.051, about 0.02 on average). (Greedy continuations may part at near-ties of these
    random models, so they are not compared with float's.)"""
    prompts = prompts_of([40, 64], seed=2)
    scored = SamplingParams(max_tokens=8, prompt_logprobs=0, **GREEDY)
    outs = {d: run(engine(path, kv_cache_dtype=d), prompts, scored) for d in ("auto", "int8")}
    for f, q in zip(outs["auto"], outs["int8"]):
        lf = torch.tensor([t.logprob for t in f.prompt_logprobs[1:]])
        lq = torch.tensor([t.logprob for t in q.prompt_logprobs[1:]])
        assert 0 < (lf - lq).abs().max() <= 0.1 and (lf - lq).abs().mean() <= 0.03


def test_int8_holds_more_blocks_in_the_same_budget(path):
    """float32 -> int8 with a float16 scale per token and KV head: 4D / (D + 2) times the blocks
    (head_dim 8: 2.67x, 16: 3.56x, 24: 3.69x, 64: 3.88x); float16 -> int8: 2D / (D + 2) (1.94x at
    SmolLM2's head_dim 64)."""
    budget = 1 << 20
    f32, i8 = (engine(path, kv_cache_memory=budget, kv_cache_dtype=d) for d in ("auto", "int8"))
    d = f32.model_config.head_dim
    assert f32.runner.bytes_per_block * (d + 2) == i8.runner.bytes_per_block * 4 * d
    assert i8.runner.num_blocks == budget // i8.runner.bytes_per_block
    assert i8.runner.num_blocks >= f32.runner.num_blocks * 4 * d // (d + 2) - 1
    assert {t.dtype for t in i8.runner.kv_cache} == {torch.int8}
    assert {t.dtype for t in i8.runner.kv_scales} == {torch.float16}
    assert 2 * 64 / (64 + 2) >= 1.9


def test_int8_padded_decode_graph_path_matches_eager(hf_checkpoints):
    path = hf_checkpoints["gqa"]
    prompts = prompts_of([3, 17, 40, 5, 33], seed=4)
    eager = tokens(run(engine(path, kv_cache_dtype="int8"), prompts, PARAMS))
    padded = engine(path, kv_cache_dtype="int8", max_num_seqs=12)
    padded.runner.enable_padded_decode()
    assert padded.runner.kv_scales[0].shape[1] == padded.runner.num_blocks + 1   # the scratch block
    assert tokens(run(padded, prompts, PARAMS)) == eager


def test_fp8_cache_runs_where_torch_supports_it(hf_checkpoints):
    """torch 2.13 on CPU stores, indexes and converts float8_e4m3fn (measured), so fp8 runs here;
    a torch or device without it is refused when the engine starts."""
    path = hf_checkpoints["gqa"]
    eng = engine(path, kv_cache_dtype="fp8_e4m3")
    assert eng.kv_cache_stats().kv_cache_dtype == "float8_e4m3fn"
    assert len(tokens(run(eng, prompts_of([9, 30]), PARAMS))[1]) == 16
    with pytest.raises(KvslimError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int3")
