"""Attention sinks + a sliding window for any model (`kv_window`, `kv_sink_tokens`,
kv_cache/window.py): greedy decoding equals a dense reference with the mask (j <= i and
(j < S or i - j < W)) on random GQA and MQA checkpoints, for windows shorter and longer than the
prompts, with chunked prefill, prefix-cache hits and preemption, on the gather and kernel
backends; the blocks behind the window are freed at once, so a long generation runs in a pool
of a few hundred token slots."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import GREEDY, engine, needs_kernels, prompts_of, run, tokens
from kvslim.attention import DenseAttention
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model
from kvslim.kv_cache.groups import blocks_held

BLOCK = 4


def dense_windowed_greedy(model, prompt: list[int], steps: int, window: int, sinks: int):
    """Greedy tokens of the dense forward over the whole sequence, every layer masked by the
    window and its sinks."""
    ids = list(prompt)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for _ in range(steps):
            x = torch.tensor([ids])
            attn = DenseAttention(len(ids), x.device, None, [window] * layers, {window: sinks})
            hidden = model(x, torch.arange(len(ids))[None], attn=attn)
            ids.append(int(model.compute_logits(hidden)[0, -1].argmax()))
    return ids[len(prompt):]


BACKENDS = ["gather", pytest.param("kernel", marks=needs_kernels)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["gqa", "mqa"])
@pytest.mark.parametrize("window,sinks", [(6, 2), (9, 4), (40, 3), (8, 0)])
def test_decoding_equals_the_dense_mask(hf_checkpoints, backend, variant, window, sinks):
    prompts = prompts_of([5, 13, 30], seed=3)
    eng = engine(hf_checkpoints[variant], block_size=BLOCK, kv_window=window,
                 kv_sink_tokens=sinks, max_num_batched_tokens=7, attention_backend=backend)
    got = tokens(run(eng, prompts, SamplingParams(max_tokens=14, **GREEDY)))
    model = load_model(hf_checkpoints[variant], dtype=torch.float32)
    assert got == [dense_windowed_greedy(model, p, 14, window, sinks) for p in prompts]
    alone = [tokens(run(eng, [p], SamplingParams(max_tokens=14, **GREEDY)))[0] for p in prompts]
    assert alone == got


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_hits_and_preemption_keep_outputs_exact(hf_checkpoints, backend):
    shared = prompts_of([37], seed=5)[0]
    prompts = [shared + [3, 4], shared + [9], shared[:20] + [1, 2, 3]]
    options = dict(block_size=BLOCK, kv_window=8, kv_sink_tokens=3, attention_backend=backend,
                   max_num_batched_tokens=16)
    roomy = engine(hf_checkpoints["gqa"], enable_prefix_caching=False, **options)
    want = tokens(run(roomy, prompts, SamplingParams(max_tokens=30, **GREEDY)))
    cached = engine(hf_checkpoints["gqa"], **options)
    got = [tokens(run(cached, [p], SamplingParams(max_tokens=30, **GREEDY)))[0]
           for p in prompts]
    assert cached.kv_cache_stats().prefix_cache_hits > 0
    assert got == want
    # 9 blocks: a step of one chunk needs 8 (kv_cache/groups.step_blocks), so the three
    # sequences' later chunks and decodes take turns.
    tight = engine(hf_checkpoints["gqa"], kv_cache_memory=9 * roomy.runner.bytes_per_block,
                   **options)
    assert tokens(run(tight, prompts, SamplingParams(max_tokens=30, **GREEDY))) == want
    assert tight.scheduler.num_preemptions > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_generation_runs_in_a_small_pool(hf_checkpoints, backend):
    """3,000 tokens past the 512 positions of the checkpoint (default RoPE) in a pool of
    under 200 token slots: every step holds only the sink and window blocks."""
    eng = engine(hf_checkpoints["mqa"], block_size=BLOCK, kv_window=32, kv_sink_tokens=4,
                 max_model_len=3100, attention_backend=backend, max_num_batched_tokens=32,
                 kv_cache_memory=48 * 2 * 1 * 16 * 4 * 2 * 2)   # 48 blocks, 2 layers
    assert eng.runner.num_blocks * BLOCK < 200
    ids = eng.add_request(prompts_of([20])[0], SamplingParams(max_tokens=3000, **GREEDY))
    peak, done = 0, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            done = out if out.finished else done
        for seq in eng.scheduler.running:
            peak = max(peak, eng.block_manager.blocks_held(seq)[0])
    assert done.request_id == ids and len(done.outputs[0].token_ids) == 3000
    assert peak == blocks_held(33, 32, BLOCK, 4) + 1 <= 11
    assert eng.kv_cache_stats().num_used_blocks == 0


def test_longrope_does_not_run_past_its_context(hf_checkpoints):
    with pytest.raises(KvslimError, match="longrope RoPE factors"):
        engine(hf_checkpoints["phi3_longrope"], kv_window=16, max_model_len=100_000,
               kv_cache_memory="1MiB")


def test_sinks_need_a_window_and_not_flex(hf_checkpoints):
    with pytest.raises(KvslimError, match="kv_sink_tokens needs kv_window"):
        engine(hf_checkpoints["gqa"], kv_sink_tokens=4)
    with pytest.raises(KvslimError, match="flex"):
        engine(hf_checkpoints["gqa"], kv_window=8, kv_sink_tokens=4, attention_backend="flex")
