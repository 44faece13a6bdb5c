"""What the learned drafters' engine tests share: greedy output with a drafter against plain
decoding, batched and alone, in an ample cache or one so small that preemptions must happen."""
from engine.engine_helpers import GREEDY, engine, run, tokens
from engine.speculative.test_spec_engine import PROMPTS
from kvslim.engine.sampling_params import SamplingParams


def greedy_equals_plain(model, speculative: dict, cache: str):
    """Asserts identical greedy output; returns the speculating engine (for its stats)."""
    params = SamplingParams(max_tokens=40, **GREEDY)
    memory = "8MiB"
    if cache == "tiny":                   # 24 blocks of 4 tokens: preemptions must happen
        memory = 24 * engine(model, block_size=4).runner.bytes_per_block
    plain = engine(model, block_size=4, kv_cache_memory=memory)
    fast = engine(model, block_size=4, kv_cache_memory=memory, speculative=speculative)
    expected = tokens(run(plain, PROMPTS, params))
    assert tokens(run(fast, PROMPTS, params)) == expected
    assert [tokens(run(fast, [p], params))[0] for p in PROMPTS] == expected
    assert fast.spec_decode_stats().num_draft_tokens > 0
    if cache == "tiny":
        assert fast.kv_cache_stats().num_preemptions > 0
    assert not fast.runner.hidden_windows.windows     # forgotten with their sequences
    return fast
