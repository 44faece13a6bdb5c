"""The engine's window and attention sinks (kv_cache/window.py): which span each layer gets
(the narrower window wins, the sinks come with the engine's window), the blocks a window group
holds with its sinks, the groups a hybrid model gets, and the one-line errors for bad values."""
import pytest

from kvslim.errors import KvslimError
from kvslim.kv_cache.groups import KVCacheGroup, blocks_held, kv_cache_groups, step_blocks
from kvslim.kv_cache.window import KVWindow, LayerSpan, layer_spans
from kvslim.models.config import ModelConfig

TYPES = ("sliding_attention", "full_attention", "sliding_attention")


def _config(**fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return ModelConfig(**{**base, **fields})


def test_the_narrower_window_wins_and_sinks_come_with_the_engines():
    hybrid = _config(sliding_window=32, layer_types=TYPES)
    assert layer_spans(hybrid, None) == (LayerSpan(32), LayerSpan(None), LayerSpan(32))
    assert layer_spans(hybrid, KVWindow(16, 4)) == (LayerSpan(16, 4),) * 3
    assert layer_spans(hybrid, KVWindow(64, 4)) == (LayerSpan(32), LayerSpan(64, 4),
                                                    LayerSpan(32))
    assert layer_spans(_config(), KVWindow(8, 2)) == (LayerSpan(8, 2),) * 3


def test_groups_of_a_hybrid_model_under_an_engine_window():
    hybrid = _config(sliding_window=32, layer_types=TYPES)
    assert kv_cache_groups(hybrid, kv_window=KVWindow(16, 4)).groups == (
        KVCacheGroup((0, 1, 2), 16, 4),)
    assert kv_cache_groups(hybrid, kv_window=KVWindow(64, 4)).groups == (
        KVCacheGroup((0,), 32, 0), KVCacheGroup((2,), 32, 0), KVCacheGroup((1,), 64, 4))


def test_a_window_group_holds_its_sink_blocks_too():
    # window 8, block 4: the next query sees 8 positions; sinks 5 keep blocks 0 and 1.
    # n = 12: blocks 0 (sink), 1 and 2 (positions 5-11 of the next query's window).
    assert [blocks_held(n, 8, 4, sinks=5) for n in (1, 4, 8, 9, 12, 100, 101)] == \
        [1, 1, 2, 3, 3, 4, 5]
    assert max(blocks_held(n, 8, 4, sinks=5) for n in range(1, 2000)) == 5
    assert max(blocks_held(n, 8, 4) for n in range(1, 2000)) == 3
    assert step_blocks(1000, 8, 4, chunk=1, sinks=5) == step_blocks(1000, 8, 4, chunk=1) + 2


@pytest.mark.parametrize("window,sinks,message", [
    (None, 4, "kv_sink_tokens needs kv_window"), (0, 0, "kv_window must be a positive"),
    (8, -1, "kv_sink_tokens must be >= 0")])
def test_bad_values_are_one_line_errors(window, sinks, message):
    with pytest.raises(KvslimError, match=message):
        KVWindow.of(window, sinks)
    assert KVWindow.of(None, 0) is None and KVWindow.of(8, None) == KVWindow(8, 0)


def test_which_rope_types_run_past_the_trained_context():
    assert _config().positions_past_context
    assert _config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 64}).positions_past_context
    long = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 64}
    assert not _config(rope_scaling=long).positions_past_context


def test_a_window_equal_to_the_models_takes_the_sinks():
    hybrid = _config(sliding_window=32, layer_types=TYPES)
    assert layer_spans(hybrid, KVWindow(32, 4)) == (LayerSpan(32, 4),) * 3
