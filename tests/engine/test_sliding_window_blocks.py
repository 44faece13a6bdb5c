"""Sliding windows that free memory: layers with a window release the blocks that fell out of
it (per KV-cache group, `kv_cache/groups.py`), so a long sequence's blocks on those layers stay
bounded, outputs stay identical to the mask-only path (every block kept), prefix caching stays
correct, and the memory planner's per-group blocks and bytes are the engine's.

Two tiny random checkpoints: `gemma3` (local, global, local layers: a hybrid cache of three
one-layer groups, window 7) and `mixtral` (every layer windowed, window 16: one group)."""
from __future__ import annotations

import pytest

from engine_helpers import GREEDY, engine, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.kv_cache.groups import (KVCacheGroup, blocks_held, first_needed_block,
                                    kv_cache_groups, longest_sequence, step_blocks)
from kvslim.models.config import ModelConfig
from kvslim.plan.memory import plan_memory

WINDOWS = {"gemma3": 7, "mixtral": 16}
BLOCK = 4


def _config(**fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    base.update(fields)
    return ModelConfig(**base)


def test_groups_by_attention_type():
    assert kv_cache_groups(_config()).groups == (KVCacheGroup(tuple(range(6)), None),)
    windowed = kv_cache_groups(_config(sliding_window=32))
    assert windowed.groups == (KVCacheGroup(tuple(range(6)), 32),)
    types = ("sliding_attention",) * 2 + ("full_attention",) + ("sliding_attention",) * 2 \
        + ("full_attention",)
    hybrid = kv_cache_groups(_config(sliding_window=32, layer_types=types))
    assert hybrid.groups == (KVCacheGroup((0, 1), 32), KVCacheGroup((3, 4), 32),
                             KVCacheGroup((2, 5), None))
    assert hybrid.group_of_layer() == [0, 0, 2, 1, 1, 2]
    assert hybrid.position_of_layer() == [0, 1, 0, 0, 1, 1]
    # Off, or layers at one storage position with different KV heads: one group, every block.
    off = kv_cache_groups(_config(sliding_window=32, layer_types=types), free_out_of_window=False)
    assert off.groups == (KVCacheGroup(tuple(range(6)), None),)
    mixed = _config(sliding_window=32, layer_types=types, layer_kv_heads=(2, 2, 1, 2, 2, 2))
    assert kv_cache_groups(mixed).groups == (KVCacheGroup(tuple(range(6)), None),)


def test_blocks_a_window_sees():
    # The next query (position n) sees the window's positions ending at itself.
    assert first_needed_block(0, 7, 4) == 0
    assert first_needed_block(10, 7, 4) == 1            # sees 4..10
    assert first_needed_block(11, 7, 4) == 1            # sees 5..11
    assert first_needed_block(12, 7, 4) == 1            # sees 6..12
    assert first_needed_block(14, 7, 4) == 2            # sees 8..14
    assert [blocks_held(n, None, 4) for n in (1, 4, 5, 56)] == [1, 1, 2, 14]
    assert max(blocks_held(n, 7, 4) for n in range(1, 500)) == 3


def _generate_tracking(eng, prompts, max_tokens):
    """Greedy outputs; asserts after every step that each running sequence holds exactly what
    `blocks_held` says in its window groups (nothing older, nothing missing), and returns the
    most blocks a sequence held in any window group."""
    windows = eng.block_manager.group_windows
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    ids = [eng.add_request(p, params) for p in prompts]
    done, peak = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        for seq in eng.scheduler.running:
            held = eng.block_manager.blocks_held(seq)
            for g, w in enumerate(windows):
                if w is not None:
                    assert held[g] == blocks_held(seq.num_computed_tokens, w, BLOCK)
                    peak = max(peak, held[g])
    assert eng.kv_cache_stats().num_used_blocks == 0, "blocks leaked"
    return tokens([done[i] for i in ids]), peak


@pytest.mark.parametrize("variant", list(WINDOWS))
def test_long_context_blocks_stay_bounded_and_outputs_equal_mask_only(hf_checkpoints, variant):
    """Context 8W on the windowed layers: blocks per sequence bounded by the window, greedy
    tokens identical to keeping every block, with chunked prefill and a batch."""
    w = WINDOWS[variant]
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(2 * w + i)] for i in range(3)]
    kwargs = dict(block_size=BLOCK, max_num_batched_tokens=2 * w - 1)
    freeing = engine(hf_checkpoints[variant], **kwargs)
    assert any(g.window for g in freeing.runner.kv_groups.groups)
    got, peak = _generate_tracking(freeing, prompts, 6 * w)
    keeping = engine(hf_checkpoints[variant], keep_out_of_window_blocks=True, **kwargs)
    assert keeping.block_manager.group_windows == (None,)
    want, _ = _generate_tracking(keeping, prompts, 6 * w)
    assert got == want
    assert peak == max(blocks_held(n, w, BLOCK) for n in range(8 * w + 3))
    assert peak <= -(-(w - 1) // BLOCK) + 1                  # independent of the context


@pytest.mark.parametrize("variant", list(WINDOWS))
def test_preemption_with_window_groups_keeps_outputs_exact(hf_checkpoints, variant):
    w = WINDOWS[variant]
    prompts = [[(5 * i + j) % 250 + 1 for j in range(w + 3 * i)] for i in range(4)]
    chunk = 8
    roomy = engine(hf_checkpoints[variant], block_size=BLOCK, max_num_batched_tokens=chunk)
    want, _ = _generate_tracking(roomy, prompts, 4 * w)
    # Room for two of the four longest sequences (every group's blocks during a step).
    longest = max(map(len, prompts)) + 4 * w
    per_seq = sum(step_blocks(longest, g, BLOCK, chunk) for g in roomy.block_manager.group_windows)
    tight = engine(hf_checkpoints[variant], block_size=BLOCK, max_num_batched_tokens=chunk,
                   kv_cache_memory=2 * per_seq * roomy.runner.bytes_per_block)
    windows = tight.block_manager.group_windows
    # Only full groups cap the context: an all-window model runs to its 512 positions.
    assert tight.max_model_len == (512 if None not in windows else longest_sequence(
        tight.runner.num_blocks, windows, BLOCK, chunk, 512))
    got, _ = _generate_tracking(tight, prompts, 4 * w)
    assert tight.scheduler.num_preemptions > 0
    assert got == want


@pytest.mark.parametrize("variant", list(WINDOWS))
def test_prefix_cache_hits_past_the_window_stay_exact(hf_checkpoints, variant):
    """A shared prefix of 4W: the second request is served from the cache (its window groups
    revive only the blocks inside the window) and answers as if computed from scratch."""
    w = WINDOWS[variant]
    prefix = [(11 * j) % 250 + 1 for j in range(4 * w)]
    prompts = [prefix + [5, 6, 7], prefix + [9, 8]]
    cached = engine(hf_checkpoints[variant], block_size=BLOCK)
    got = []
    for prompt in prompts:                               # one after the other: the 2nd hits
        out, _ = _generate_tracking(cached, [prompt], 2 * w)
        got += out
    stats = cached.kv_cache_stats()
    assert stats.prefix_cache_hits >= (4 * w // BLOCK - 1) * BLOCK
    uncached = engine(hf_checkpoints[variant], block_size=BLOCK, enable_prefix_caching=False)
    want, _ = _generate_tracking(uncached, prompts, 2 * w)
    assert got == want


@pytest.mark.parametrize("variant", list(WINDOWS))
def test_planner_agrees_with_engine_per_group(hf_checkpoints, variant):
    """At every decode step of a long sequence, each group's blocks and bytes in the engine
    equal `kvslim memory`'s plan at that context."""
    w = WINDOWS[variant]
    eng = engine(hf_checkpoints[variant], block_size=BLOCK)
    spec = ModelConfig.from_dir(hf_checkpoints[variant], runnable=False)
    eng.add_request([3] * w, SamplingParams(max_tokens=7 * w, **GREEDY))
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            n = seq.num_computed_tokens
            if n % (2 * w) or seq.num_uncomputed_tokens != 1:
                continue
            plan = plan_memory(spec, context=n, block_size=BLOCK, kv_dtype="fp32")
            held = eng.block_manager.blocks_held(seq)
            assert [g.blocks_per_sequence for g in plan.kv_groups] == held
            assert [g.bytes for g in plan.kv_groups] == \
                [b * eng.runner.bytes_per_block for b in held]
            assert [tuple(g.layers) for g in plan.kv_groups] == \
                [g.layers for g in eng.runner.kv_groups.groups]
            checked += 1
    assert checked >= 3
