"""Self-speculation (speculative method "self", engine/speculative/self_draft.py): the target
drafts with attention over sinks + a window of its own context and verifies against the full
cache. Greedy output is plain decoding's on random GQA, MQA and sliding-window checkpoints,
alone and batched, under preemption; sampling by the exact rule; the draft's windowed cache
releases what falls behind its window and frees everything at the end."""
import pytest

from engine.engine_helpers import GREEDY, engine, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError

PROMPTS = [list(range(40, 100)), [5, 6, 7, 8, 9, 10] * 8, [3, 1, 4, 1, 5, 9] * 3,
           [100 + (i % 7) for i in range(50)]]


def spec(k: int, window: int = 16, sinks: int = 4) -> dict:
    return dict(method="self", num_speculative_tokens=k, kv_window=window,
                kv_sink_tokens=sinks, disable_by_batch_size=None)


@pytest.mark.parametrize("variant", ["gqa", "mqa", "gemma3"])
@pytest.mark.parametrize("cache", ["ample", "tiny"])
def test_greedy_output_equals_plain_decoding(hf_checkpoints, variant, cache):
    params = SamplingParams(max_tokens=40, **GREEDY)
    memory = "8MiB"
    if cache == "tiny":                   # preemptions must happen
        blocks = 80 if variant == "gemma3" else 40     # the longest request must fit
        memory = blocks * engine(hf_checkpoints[variant], block_size=4).runner.bytes_per_block
    plain = engine(hf_checkpoints[variant], block_size=4, kv_cache_memory=memory)
    fast = engine(hf_checkpoints[variant], block_size=4, kv_cache_memory=memory,
                  speculative=spec(3))
    prompts = PROMPTS * 2 if cache == "tiny" else PROMPTS    # more than the cache holds
    assert tokens(run(fast, prompts, params)) == tokens(run(plain, prompts, params))
    alone = [tokens(run(fast, [p], params))[0] for p in PROMPTS[:2]]
    assert alone == tokens(run(plain, PROMPTS[:2], params))
    stats = fast.spec_decode_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if cache == "tiny":
        assert fast.kv_cache_stats().num_preemptions > 0
    assert fast.spec.draft.block_manager.num_used_blocks == 0 and not fast.spec.draft.mirrors


def test_the_drafts_cache_holds_only_its_window(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4, speculative=spec(2, window=8, sinks=4))
    eng.add_request(list(range(40, 100)), SamplingParams(max_tokens=20, **GREEDY))
    for _ in range(6):
        eng.step()
    draft = eng.spec.draft
    (mirror,) = draft.mirrors.values()
    held = draft.block_manager.blocks_held(mirror)
    # sinks (1 block) + the window's blocks and the step's drafts, not the 60+ tokens' 15+
    assert 0 < held[0] <= 1 + 3 + 2


def test_a_window_is_required(hf_checkpoints):
    with pytest.raises(KvslimError, match="'self' needs kv_window"):
        engine(hf_checkpoints["gqa"], speculative=dict(method="self"))
    with pytest.raises(KvslimError, match="takes no 'model'"):
        engine(hf_checkpoints["gqa"], speculative=dict(method="self", kv_window=8, model="x"))
