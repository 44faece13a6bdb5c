"""Trees of drafts in the engine: greedy output identical to plain decoding for Medusa trees and
EAGLE trees of several shapes (batched and alone, preemption forced by a tiny cache, prefix-cache
hits, an int8 cache), no blocks left after rejections and aborts, the accepted depth counted per
position, and trees that cannot be served refused before serving."""
import pytest

from engine.engine_helpers import GREEDY, engine, run, tokens
from engine.speculative.learned_helpers import greedy_equals_plain
from engine.speculative.test_eagle_engine import eagle, write_eagle
from engine.speculative.test_medusa_engine import medusa, write_heads
from engine.speculative.test_spec_engine import PROMPTS
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError

WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]
BEST_CHAIN = [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1]]


def tree_spec(make, path, tree, **extra):
    spec = make(path, len(max(tree, key=len)), **extra)
    spec.update(tree=tree)
    return spec


@pytest.mark.parametrize("tree", [WIDE, [[0], [1], [0, 0]]], ids=["wide", "small"])
@pytest.mark.parametrize("scale", [0.0, 0.5], ids=["untrained", "random"])
@pytest.mark.parametrize("cache", ["ample", "tiny"])
def test_medusa_trees_keep_greedy_output(hf_checkpoints, tmp_path, tree, scale, cache):
    model = hf_checkpoints["gqa"]
    heads = write_heads(tmp_path / "heads", model, scale=scale)
    fast = greedy_equals_plain(model, tree_spec(medusa, heads, tree), cache)
    stats = fast.spec_decode_stats()
    assert len(stats.drafted_per_position) == 3 if tree is WIDE else 2
    if scale == 0.0:                      # "the next token again": right where it repeats
        assert stats.num_accepted_tokens > 0
    if tree is WIDE:                      # the tree's other branches were taken too
        assert stats.num_accepted_off_chain > 0
    assert fast.kv_cache_stats().num_used_blocks == 0


@pytest.mark.parametrize("kind", ["copy", "random"])
def test_eagle_trees_keep_greedy_output(hf_checkpoints, tmp_path, kind):
    model = hf_checkpoints["gqa"]
    head = write_eagle(tmp_path / "eagle", model, kind, window=16)
    fast = greedy_equals_plain(model, tree_spec(eagle, head, BEST_CHAIN), "tiny")
    assert fast.kv_cache_stats().num_used_blocks == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_prefix_cache_hits_and_int8_caches_keep_greedy_output(hf_checkpoints, tmp_path,
                                                              kv_cache_dtype):
    model = hf_checkpoints["gqa"]
    heads = write_heads(tmp_path / "heads", model, scale=0.5)
    params = SamplingParams(max_tokens=30, **GREEDY)
    prompt = PROMPTS[0] * 3
    plain = engine(model, block_size=4, kv_cache_dtype=kv_cache_dtype)
    fast = engine(model, block_size=4, enable_prefix_caching=True,
                  kv_cache_dtype=kv_cache_dtype, speculative=tree_spec(medusa, heads, WIDE))
    expected = tokens(run(plain, [prompt], params))
    assert tokens(run(fast, [prompt], params)) == expected
    assert tokens(run(fast, [prompt, prompt], params)) == expected * 2
    assert fast.kv_cache_stats().prefix_cache_hits > 0


def test_sampling_and_aborts_leave_no_blocks(hf_checkpoints, tmp_path):
    model = hf_checkpoints["gqa"]
    heads = write_heads(tmp_path / "heads", model, scale=0.0)
    fast = engine(model, block_size=4, speculative=tree_spec(medusa, heads, WIDE))
    outs = run(fast, PROMPTS, SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                             ignore_eos=True))
    assert all(len(t) == 20 for t in tokens(outs))
    for i, prompt in enumerate(PROMPTS):
        fast.add_request(prompt, SamplingParams(max_tokens=50, **GREEDY), f"abort-{i}")
    for _ in range(3):
        fast.step()
    for i in range(len(PROMPTS)):
        fast.abort_request(f"abort-{i}")
    assert fast.kv_cache_stats().num_used_blocks == 0
    assert fast.spec_decode_stats().num_draft_tokens > 0


def test_trees_that_cannot_be_served_are_refused(hf_checkpoints, tmp_path):
    model = hf_checkpoints["gqa"]
    heads = write_heads(tmp_path / "heads", model, num_heads=2)
    with pytest.raises(KvslimError, match="num_speculative_tokens 3 is more than the 2 Medusa"):
        engine(model, speculative=tree_spec(medusa, heads, WIDE))
    head = write_eagle(tmp_path / "eagle", model)
    with pytest.raises(KvslimError, match="every rank of a tree node but its last must be 0"):
        engine(model, speculative=tree_spec(eagle, head, WIDE))
    with pytest.raises(KvslimError, match="needs a learned drafter"):
        engine(model, speculative=dict(method="ngram", tree=[[0]]))
    with pytest.raises(KvslimError, match=r"node \[0, 1\] has no parent \[0\]"):
        engine(model, speculative=dict(method="medusa", model=heads, tree=[[1], [0, 1]]))
    with pytest.raises(KvslimError, match="differs from the draft tree's depth 2"):
        engine(model, speculative=dict(method="medusa", model=heads, tree=[[0], [0, 0]],
                                       num_speculative_tokens=1))
    with pytest.raises(KvslimError, match="1 to 63 nodes"):
        engine(model, speculative=dict(method="medusa", model=heads,
                                       tree=[[i] for i in range(64)]))


def test_gemma3_trees_keep_greedy_output_and_windows_bound_the_depth(hf_checkpoints, tmp_path):
    """Local layers with a window of 7 between global ones: a tree's rows read their own
    window; a depth reaching the window is refused (a row's ancestors must lie inside it)."""
    model = hf_checkpoints["gemma3"]
    head = write_eagle(tmp_path / "eagle", model, "random", window=16, draft_vocab=64)
    greedy_equals_plain(model, tree_spec(eagle, head, BEST_CHAIN), "ample")
    with pytest.raises(KvslimError, match="num_speculative_tokens 7 reaches the model's "
                                          "sliding window of 7"):
        engine(model, speculative=eagle(head, 7))
