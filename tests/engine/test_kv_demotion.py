"""Demotion instead of preemption (`--kv-pressure demote`, engine/kv_demotion.py): under
pressure the engine demotes blocks to int8 in place rather than preempting, leaks no block, no
page and no int8 block; a sequence whose blocks were never demoted decodes exactly what it
decodes alone; demoted blocks hold the int8 cache's quantization of what they held; one-line
errors for what demotion does not run with."""
import pytest
import torch

from engine_helpers import GREEDY, engine, needs_kernels, prompts_of, run, tokens
from kvslim.attention.kv_cache import dequantize, quantize
from kvslim.engine.block_manager import BlockManager
from kvslim.engine.kv_demotion import demoted_entry
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.sequence import Sequence
from kvslim.errors import KvslimError
from kvslim.kernels.paged_attention import demoted_view

BLOCK = 4
PARAMS = SamplingParams(max_tokens=24, **GREEDY)


@pytest.fixture(scope="module")
def path(hf_checkpoints):
    return hf_checkpoints["gqa"]


def tight_engine(path, mode: str, blocks: int):
    """An engine whose pool holds about `blocks` float32 blocks."""
    probe = engine(path, block_size=BLOCK, kv_pressure=mode)
    per_block = probe.kv_cache_stats().bytes_per_block
    return engine(path, block_size=BLOCK, kv_pressure=mode,
                  kv_cache_memory=int(blocks * per_block + per_block // 2))


def step_all(eng, prompts, params, seen_demoted: set[int]) -> list[list[int]]:
    """Run to the end, noting which requests ever held a demoted block."""
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        for seq in eng.scheduler.running:
            if any(b < -1 for b in seq.block_tables[0]):
                seen_demoted.add(seq.request_id)
    assert eng.kv_cache_stats().num_used_blocks == 0, "blocks leaked"
    return [done[i].outputs[0].token_ids for i in ids], ids


@needs_kernels
@pytest.mark.parametrize("variant,lengths,blocks", [
    ("gqa", [20, 24, 18, 30, 22, 26], 30),
    ("gemma3", [14, 16, 12, 15, 13, 16], 40)])    # gemma3: window groups beside a full one
def test_pressure_demotes_instead_of_preempting_and_leaks_nothing(hf_checkpoints, variant,
                                                                   lengths, blocks):
    path, params = hf_checkpoints[variant], SamplingParams(max_tokens=20, **GREEDY)
    prompts = prompts_of(lengths, seed=1)
    preempting = tight_engine(path, "preempt", blocks)
    run(preempting, prompts, params)
    assert preempting.scheduler.num_preemptions > 0          # the pool is under pressure
    demoting = tight_engine(path, "demote", blocks)
    run(demoting, prompts, params)                             # checks no block is in use
    stats = demoting.kv_cache_stats()
    assert stats.num_demoted_blocks > 0 and stats.num_preemptions == 0
    demotion = demoting.block_manager.demotion
    assert not demotion.pages and not demotion.open and not demotion.copies
    assert stats.num_free_blocks == stats.num_blocks


@needs_kernels
def test_a_sequence_demotion_did_not_touch_decodes_what_it_decodes_alone(path):
    """The oldest sequences' blocks go first: the newest one here is never demoted, and its
    tokens equal its tokens alone in a pool without pressure."""
    prompts = prompts_of([40, 36, 12], seed=2)
    eng = tight_engine(path, "demote", 28)
    demoted: set[str] = set()
    got, ids = step_all(eng, prompts, PARAMS, demoted)
    assert ids[0] in demoted and ids[2] not in demoted, (ids, demoted)
    alone = tokens(run(engine(path, block_size=BLOCK), [prompts[2]], PARAMS))[0]
    assert got[2] == alone
    assert eng.kv_cache_stats().num_preemptions == 0


def sequence(tokens: list[int]) -> Sequence:
    return Sequence(request_id="r", token_ids=tokens, params=PARAMS, block_size=BLOCK)


def seq_with_blocks(bm: BlockManager, n_tokens: int) -> Sequence:
    seq = sequence(list(range(n_tokens)))
    bm.allocate(seq)
    seq.num_computed_tokens = n_tokens
    return seq


def test_four_demotions_free_three_blocks_and_free_gives_every_one_back():
    bm = BlockManager(16, BLOCK, enable_prefix_caching=True, demote=True)
    seq = seq_with_blocks(bm, 6 * BLOCK)
    first = list(seq.block_tables[0])
    free = bm.num_free_blocks
    for _ in range(4):
        assert bm.demote([seq])
    assert bm.num_free_blocks == free + 3
    # the first block's bytes became the page; the three after it were freed
    assert seq.block_tables[0][:4] == [demoted_entry(4 * first[0] + q) for q in range(4)]
    assert bm.demotion.take_copies() == [(first[q], 4 * first[0] + q) for q in range(4)]
    assert seq.block_tables[0][4:] == first[4:]
    bm.free(seq)
    assert bm.num_free_blocks == 16 and not bm.demotion.pages and not bm.demotion.open


def test_a_shared_block_and_the_block_being_written_are_never_demoted():
    bm = BlockManager(16, BLOCK, demote=True)
    parent = seq_with_blocks(bm, 2 * BLOCK + 1)
    child = sequence(list(parent.token_ids))
    bm.fork(parent, child)
    assert not bm.demote([parent, child])             # both full blocks shared, third partial
    bm.free(child)
    assert bm.demote([parent]) and bm.demote([parent]) and not bm.demote([parent])
    assert parent.block_tables[0][2] >= 0              # still being written
    bm.free(parent)
    assert bm.num_free_blocks == 16 and not bm.demotion.pages


def test_a_fork_after_demotion_shares_the_int8_blocks():
    bm = BlockManager(16, BLOCK, demote=True)
    parent = seq_with_blocks(bm, 3 * BLOCK)
    assert bm.demote([parent])
    child = sequence(list(parent.token_ids))
    bm.fork(parent, child)
    bm.free(parent)
    assert bm.demotion.pages                           # the child still reads it
    bm.free(child)
    assert bm.num_free_blocks == 16 and not bm.demotion.pages and not bm.demotion.open


@needs_kernels
def test_demoted_blocks_hold_the_int8_quantization_even_inside_a_source(path):
    """Four blocks demoted into the first one's bytes: every source is read before the
    page is written."""
    eng = engine(path, block_size=BLOCK, kv_pressure="demote")
    storage = eng.runner.storage
    for kv in storage.kv_cache:
        kv.copy_(torch.randn_like(kv))
    before = [kv.clone() for kv in storage.kv_cache]
    copies = [(5, 20), (6, 21), (7, 22), (9, 23)]        # int8 blocks 20-23: block 5's bytes
    storage.demote_blocks(copies)
    for kv, old, scales in zip(storage.kv_cache, before, storage.demoted_scales):
        for i in range(2):
            for src, dst in copies:
                q, s = quantize(old[i, src], torch.int8)
                assert torch.equal(demoted_view(kv[i])[dst], q)
                assert torch.equal(scales[i, dst], s)
                back = dequantize(demoted_view(kv[i])[dst], scales[i, dst], torch.float32)
                assert (back - old[i, src]).abs().max() <= old[i, src].abs().max() / 127


@pytest.mark.parametrize("options,message", [
    (dict(kv_cache_dtype="int8"), "does not run with kv_cache_dtype"),
    (dict(kv_window=8), "does not run with kv_window"),
    (dict(speculative={"method": "ngram", "num_speculative_tokens": 2}),
     "does not run with speculative"),
])
def test_what_demotion_does_not_run_with_is_refused(path, options, message):
    with pytest.raises(KvslimError, match=message):
        engine(path, kv_pressure="demote", **options)


@needs_kernels
def test_a_model_off_the_float32_kernel_is_refused(path):
    with pytest.raises(KvslimError, match="decode kernel over a float32 cache"):
        engine(path, kv_pressure="demote", attention_backend="gather")
