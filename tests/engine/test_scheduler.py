"""Scheduler: continuous batching, chunked prefill, limits, preemption, FCFS and abort — with a
fake model that always samples token 7."""
from kvslim.engine.block_manager import BlockManager
from kvslim.engine.long_rope import LongRopeSwitch
from kvslim.engine.sampler import SampleResult
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.scheduler import Scheduler
from kvslim.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, **kw):
    bm = BlockManager(num_blocks, block_size, **kw)
    return Scheduler(bm, max_num_seqs, budget, eos_token_ids=[0]), bm


def add(sched, n_prompt, max_tokens=8, n=1, name="r"):
    s = Sequence(request_id=name, token_ids=list(range(1, n_prompt + 1)),
                 params=SamplingParams(max_tokens=max_tokens, n=n, temperature=0),
                 block_size=sched.bm.block_size, fork_pending=n > 1)
    sched.add(s)
    return s


def step(sched, token=7):
    out = sched.schedule()
    sampled = {e.seq.seq_id: [SampleResult(token, None)] * e.num_samples
               for e in out.scheduled if e.sample}
    sched.postprocess(out, sampled)
    return out


def plan(out):
    return [(e.seq.request_id, e.num_tokens) for e in out.scheduled]


def test_chunked_prefill_runs_beside_decodes():
    sched, _ = make(budget=8)
    add(sched, 3, name="a")
    add(sched, 20, name="b")
    assert plan(step(sched)) == [("a", 3), ("b", 5)]
    assert plan(step(sched)) == [("a", 1), ("b", 7)]
    assert plan(step(sched)) == [("a", 1), ("b", 7)]
    out = step(sched)                           # b's last prompt token: one query, sampled
    assert plan(out) == [("a", 1), ("b", 1)]
    assert [e.sample for e in out.scheduled] == [True, True]


def test_sequences_join_and_leave_every_step():
    sched, bm = make()
    a = add(sched, 4, max_tokens=2, name="a")
    step(sched)
    b = add(sched, 4, max_tokens=3, name="b")     # arrives while a decodes
    assert plan(step(sched)) == [("a", 1), ("b", 4)]
    assert a.finish_reason == "length" and a.status is SequenceStatus.FINISHED
    assert sched.running == [b]
    step(sched)
    step(sched)
    assert b.output_token_ids == [7, 7, 7] and not sched.has_unfinished()
    assert bm.num_used_blocks == 0


def test_max_num_seqs_limits_the_batch():
    sched, _ = make(max_num_seqs=2)
    for name in "abc":
        add(sched, 2, max_tokens=2, name=name)
    assert plan(step(sched)) == [("a", 2), ("b", 2)]
    assert [s.request_id for s in sched.waiting] == ["c"]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]   # both finish (2 tokens)
    assert plan(step(sched)) == [("c", 2)]


def test_preemption_takes_the_newest_and_recomputes():
    sched, bm = make(num_blocks=4, block_size=2, budget=16)
    a = add(sched, 3, max_tokens=4, name="a")
    b = add(sched, 3, max_tokens=4, name="b")
    step(sched)                                  # 2 blocks each: cache full
    step(sched)                                  # position 3 still fits in block 1
    assert bm.num_free_blocks == 0
    out = step(sched)                            # a needs a 3rd block: b (newest) is preempted
    assert plan(out) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.block_table == []
    assert b.output_token_ids == [7, 7]          # its tokens are kept, only K/V are recomputed
    assert b.seq_id in out.released_seq_ids
    while sched.has_unfinished():
        step(sched)
    assert a.output_token_ids == b.output_token_ids == [7] * 4
    assert bm.num_used_blocks == 0


def test_fcfs_head_of_queue_is_not_overtaken():
    sched, _ = make(num_blocks=4, block_size=4, budget=64)
    add(sched, 12, max_tokens=2, name="a")       # 3 blocks
    add(sched, 8, max_tokens=2, name="big")      # needs 2 blocks (+ watermark 0): waits
    add(sched, 1, max_tokens=2, name="small")    # would fit, but must not jump the queue
    assert plan(step(sched)) == [("a", 12)]
    assert [s.request_id for s in sched.waiting] == ["big", "small"]


def test_abort_frees_blocks_in_any_state():
    sched, bm = make(max_num_seqs=1)
    a = add(sched, 5, name="a")
    b = add(sched, 5, name="b")
    step(sched)
    assert bm.num_used_blocks == 2
    sched.finish(b, "abort")                     # waiting
    sched.finish(a, "abort")                     # running
    assert bm.num_used_blocks == 0 and not sched.has_unfinished()
    assert a.finish_reason == b.finish_reason == "abort"


def test_n_gt_1_forks_after_prefill_and_shares_prompt_blocks():
    sched, bm = make(block_size=4)
    parent = add(sched, 10, max_tokens=3, n=4, name="a")
    out = step(sched)
    assert [e.num_samples for e in out.scheduled] == [4]
    family = [s for s in sched.running]
    assert len(family) == 4 and sorted(s.index for s in family) == [0, 1, 2, 3]
    assert all(s.block_table == parent.block_table for s in family)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [4, 4, 4]
    step(sched)                                  # each writes into the shared half block: CoW
    assert len({s.block_table[2] for s in family}) == 4
    assert [bm.blocks[b].ref_count for b in parent.block_table[:2]] == [4, 4]
    while sched.has_unfinished():
        step(sched)
    assert bm.num_used_blocks == 0


def test_eos_stops_unless_ignored_or_min_tokens():
    sched, _ = make()
    a = add(sched, 3, max_tokens=5, name="a")
    step(sched, token=0)
    assert a.finish_reason == "stop" and a.output_token_ids == [0]
    b = add(sched, 3, max_tokens=3, name="b")
    b.params.ignore_eos = True
    while sched.has_unfinished():
        step(sched, token=0)
    assert b.finish_reason == "length" and b.output_token_ids == [0, 0, 0]


def longrope_scheduler(original: int):
    bm = BlockManager(64, 4)
    return Scheduler(bm, 8, 64, eos_token_ids=[0], length_switch=LongRopeSwitch(original)), bm


def test_a_prompt_beyond_longrope_original_context_is_long_from_the_start():
    sched, _ = longrope_scheduler(8)
    short, at, beyond = add(sched, 7, name="a"), add(sched, 8, name="b"), add(sched, 9, name="c")
    assert [s.long_rope for s in (short, at, beyond)] == [False, False, True]


def test_a_sequence_growing_past_longrope_original_context_is_recomputed():
    """Its K/V were rotated by the short factors: all of them are computed again, under a
    prefix-cache key of their own."""
    sched, bm = longrope_scheduler(8)
    seq = add(sched, 7, name="a")
    step(sched)                                  # prompt; its 8th token sampled: still short
    assert not seq.long_rope and seq.num_computed_tokens == 7
    short_hashes = list(seq.block_hashes)
    step(sched)                                  # the 8th token computed, a 9th sampled
    assert seq.long_rope and seq.num_tokens == 9
    assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
    assert bm.blocks_held(seq) == [0] and seq.num_preemptions == 0
    out = step(sched)
    assert plan(out) == [("a", 9)] and out.scheduled[0].start == 0   # no short block reused
    assert seq.block_hashes[0] != short_hashes[0]


def test_drafts_stop_at_longrope_original_context():
    """A short sequence verifies drafts up to the original context's last position only."""
    sched, _ = longrope_scheduler(8)
    seq = add(sched, 5, name="a")
    step(sched)                                  # prompt; 6 tokens
    sched.proposals = FixedProposals({seq.seq_id: [7, 7, 7, 7]})
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [7, 7]    # positions 5, 6, 7


class FixedProposals:
    """TokenProposals that propose given tokens once (a chain)."""

    def __init__(self, tokens: dict[int, list[int]]):
        self.tokens = tokens

    def take(self, seq):
        return self.tokens.pop(seq.seq_id, []), None
