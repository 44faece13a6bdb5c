"""Property test: the real `Scheduler` and `BlockManager` driven through thousands of random
workloads (token budgets down to 1, tiny caches that force preemption, n > 1 forks, prompt
logprobs, aborts, shared prefixes for prefix-cache hits) by a fake model runner that keeps a
fingerprint of every KV-cache slot. After every step:

- every block is free or owned exactly as the sequences' block tables say (reference counts),
  and every cached digest points at a block that holds it;
- with KV-cache groups that have a sliding window (Gemma 3, Mistral), a sequence holds no
  block its next query can no longer see, and the blocks it reads inside the window are its
  own group's (so a window-group prefix hit never serves released or foreign K/V);
- every position a sequence attends to holds the K/V of exactly its own prefix (so prefix hits,
  copy-on-write and preemption never serve another sequence's K/V);
- scheduled work stays within the token budget and max_num_seqs;
- with demotion (`--kv-pressure demote`), every int8 block and page is referenced exactly as the
  tables say, and a demoted position reads what its float32 block held (a page's float32 slots
  read as garbage, and a float32 write into a page's bytes wipes its int8 blocks).

At the end every sequence produced exactly its expected tokens (none lost or repeated), and every
prompt token after the first has exactly one prompt logprob."""
from __future__ import annotations

import os
import zlib
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvslim.engine.block_manager import BlockManager
from kvslim.engine.kv_demotion import QUARTERS, int8_block
from kvslim.engine.sampler import SampleResult
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.scheduler import Scheduler
from kvslim.engine.sequence import Sequence, SequenceStatus, TokenLogprob
from kvslim.kv_cache.groups import NULL_BLOCK, first_needed_block

EOS = 0
VOCAB = 12
MAX_STEPS = 3000
EXAMPLES = int(os.environ.get("KVSLIM_PROPERTY_EXAMPLES", 2000))
SALT = os.environ.get("KVSLIM_PROPERTY_SALT", "")      # other sampled tokens, same workloads


@dataclass
class Request:
    name: str
    prompt: list[int]
    n: int
    max_tokens: int
    prompt_logprobs: bool
    arrival: int                       # step at which it is added
    abort_at: int | None               # step at which it is aborted (None: never)
    ignore_eos: bool = False
    seqs: list[Sequence] = field(default_factory=list)


def next_token(name: str, index: int, position: int) -> int:
    """What the fake model samples: a function of the completion and its length only, so a
    completion's expected output does not depend on what else ran beside it."""
    return zlib.crc32(f"{SALT}/{name}/{index}/{position}".encode()) % VOCAB


def expected_output(req: Request, index: int) -> list[int]:
    out = []
    while len(out) < req.max_tokens:
        out.append(next_token(req.name, index, len(out)))
        if out[-1] == EOS and not req.ignore_eos:
            break
    return out


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(2, 24))
    budget = draw(st.integers(1, 24))
    chunked = draw(st.booleans()) or budget >= 8
    window = draw(st.integers(1, 9))
    windows = draw(st.sampled_from([(None,), (None,), (window,), (window, None),
                                    (None, window, window)]))
    num_blocks = max(num_blocks, 2 * len(windows))      # one sequence of 2+ tokens fits
    config = dict(block_size=block_size, num_blocks=num_blocks, budget=budget, windows=windows,
                  max_num_seqs=draw(st.integers(1, 6)), chunked=chunked,
                  prefix_caching=draw(st.booleans()), watermark=draw(st.sampled_from([0, 1])),
                  demote=draw(st.booleans()))
    capacity = num_blocks // len(windows) * block_size
    prefixes = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=8, max_size=8))
                for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        head = draw(st.sampled_from(prefixes))[:draw(st.integers(0, 8))]
        tail = draw(st.lists(st.integers(1, VOCAB - 1), max_size=12))
        # Only what admission lets in: one sequence fits the whole cache, n fits the batch,
        # and an unchunked prompt fits the budget.
        prompt = ((head + tail) or [1])[:capacity - 1][:budget if not chunked else None]
        max_tokens = min(draw(st.integers(1, 8)), capacity - len(prompt))
        n = min(draw(st.integers(1, 3)), config["max_num_seqs"])
        arrival = draw(st.integers(0, 6))
        abort_at = draw(st.one_of(st.none(), st.integers(arrival, arrival + 12)))
        requests.append(Request(f"r{i}", prompt, n, max_tokens, draw(st.booleans()),
                                arrival, abort_at))
    return config, requests


class FakeRunner:
    """Writes a fingerprint (the token prefix ending there) into every slot a step computes,
    and checks every slot a scheduled sequence attends to."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[int, list] = {b: [None] * bm.block_size for b in range(bm.num_blocks)}
        self.int8: dict[int, list] = {}          # int8 block -> its slots' fingerprints

    def execute(self, out) -> dict[int, list[SampleResult]]:
        self._demote(out.demotions)
        for src, dst in out.block_copies:
            self._write(dst, list(self.slots[src]))
        bs = self.bm.block_size
        for entry in out.scheduled:
            seq = entry.seq
            for g, table in enumerate(seq.block_tables):
                for pos in range(entry.start, entry.start + entry.num_tokens):
                    slots = self._write(table[pos // bs])
                    slots[pos % bs] = (g, tuple(seq.token_ids[:pos + 1]))
        sampled = {}
        for entry in out.scheduled:
            self._check_reads(entry)
            seq = entry.seq
            for pos in entry.prompt_logprob_positions:
                assert pos == len(seq.prompt_logprobs) - 1, "prompt logprob out of order"
                seq.prompt_logprobs.append(TokenLogprob(seq.token_ids[pos + 1], 0.0, []))
            if entry.sample:
                sampled[seq.seq_id] = [
                    SampleResult(next_token(seq.request_id, seq.index + k, seq.num_output_tokens),
                                 None) for k in range(entry.num_samples)]
        return sampled

    def _demote(self, demotions) -> None:
        """Every source read before any int8 block is written; an int8 block's page (a
        float32 block) then reads as garbage in float32."""
        held = [list(self.slots[src]) for src, _ in demotions]
        for (_, dst), slots in zip(demotions, held):
            self.int8[dst] = slots
            self.slots[dst // QUARTERS] = [("page",)] * self.bm.block_size

    def _write(self, block: int, slots: list | None = None) -> list:
        """A float32 write into `block` (whole, or returns its slots to write into): its
        bytes no longer hold the int8 blocks of a page."""
        for q in range(QUARTERS):
            self.int8.pop(block * QUARTERS + q, None)
        if slots is not None:
            self.slots[block] = slots
        return self.slots[block]

    def _check_reads(self, entry) -> None:
        """Every position the chunk attends to, in every group (a window group: from the first
        one its first query sees), holds the group's own K/V of this sequence's prefix."""
        seq, bs = entry.seq, self.bm.block_size
        for g, (table, window) in enumerate(zip(seq.block_tables, self.bm.group_windows)):
            first = 0 if window is None else max(0, entry.start - window + 1)
            for pos in range(first, entry.start + entry.num_tokens):
                block = table[pos // bs]
                got = (None if block == NULL_BLOCK else self.slots[block][pos % bs]
                       if block >= 0 else self.int8[int8_block(block)][pos % bs])
                assert got == (g, tuple(seq.token_ids[:pos + 1])), \
                    f"{seq.request_id}/{seq.index} reads wrong K/V at position {pos}, group {g}"


def check_step(sched: Scheduler, bm: BlockManager, out, live: list[Sequence]) -> None:
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len({id(e.seq) for e in out.scheduled}) == len(out.scheduled)
    for entry in out.scheduled:
        seq = entry.seq
        assert seq.status is SequenceStatus.RUNNING and entry.num_tokens >= 1
        assert entry.start == seq.num_computed_tokens
        assert entry.start + entry.num_tokens <= seq.num_tokens
        for table in seq.block_tables:
            assert len(table) * bm.block_size >= entry.start + entry.num_tokens
    # Copies go only into blocks a scheduled sequence owns (a preempted one's are dropped).
    owned = {b for e in out.scheduled for t in e.seq.block_tables for b in t}
    assert all(dst in owned for _, dst in out.block_copies), "copy into a block nobody owns"
    # Work-conserving: a running sequence waits only when the budget is spent (the tokens of
    # a sequence preempted during scheduling go back to the budget).
    scheduled = {id(e.seq) for e in out.scheduled}
    if any(id(s) not in scheduled for s in sched.running):
        assert out.num_batched_tokens == sched.max_num_batched_tokens, "budget left unused"
    check_blocks(sched, bm, live)


def check_blocks(sched: Scheduler, bm: BlockManager, live: list[Sequence]) -> None:
    rows = sum(s.params.n if s.fork_pending else 1 for s in sched.running)
    assert rows <= sched.max_num_seqs, "more sequences than max_num_seqs (forks included)"
    owners = Counter(b for s in live for t in s.block_tables for b in t if b != NULL_BLOCK)
    if bm.demotion is not None:
        check_demoted(bm, owners)
    for seq in live:
        if seq.status is not SequenceStatus.RUNNING:
            assert not any(seq.block_tables), f"{seq.request_id} holds blocks while not running"
            continue
        for table, window in zip(seq.block_tables, bm.group_windows):
            first = first_needed_block(seq.num_computed_tokens, window, bm.block_size)
            assert all(b == NULL_BLOCK for b in table[:first]), \
                f"{seq.request_id} keeps a block out of its window"
            assert NULL_BLOCK not in table[first:], f"{seq.request_id} lost a visible block"
    for block in bm.blocks:
        assert block.ref_count == owners[block.block_id], f"block {block.block_id} refcount"
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
    for digest, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == digest
    assert bm.num_cached_free_blocks == sum(bm.blocks[b].hash is not None for b in bm.free_queue)


def check_demoted(bm: BlockManager, owners: Counter) -> None:
    """Each int8 block's references are the table entries naming it; a page is a taken
    float32 block with something in it, its free quarters open."""
    demotion = bm.demotion
    for page, refs in demotion.pages.items():
        assert any(refs), f"page {page} is empty but held"
        for q, n in enumerate(refs):
            block = page * QUARTERS + q
            assert n == owners.pop(-2 - block, 0), f"int8 block {block} refcount"
            assert (n == 0) == (block in demotion.open)
        owners[page] += 1                      # the page holds its float32 block
    assert not [b for b in owners if b < NULL_BLOCK], "a table names a freed int8 block"


def simulate(config: dict, requests: list[Request]) -> BlockManager:
    bm = BlockManager(config["num_blocks"], config["block_size"], config["prefix_caching"],
                      watermark_blocks=config["watermark"],
                      group_windows=config.get("windows", (None,)),
                      demote=config.get("demote", False))
    sched = Scheduler(bm, config["max_num_seqs"], config["budget"], [EOS], config["chunked"])
    runner = FakeRunner(bm)
    for step in range(MAX_STEPS):
        for req in requests:
            if req.arrival == step:
                params = SamplingParams(n=req.n, max_tokens=req.max_tokens, temperature=0,
                                        ignore_eos=req.ignore_eos,
                                        prompt_logprobs=0 if req.prompt_logprobs else None)
                req.seqs.append(Sequence(req.name, list(req.prompt), params,
                                         config["block_size"], fork_pending=req.n > 1))
                sched.add(req.seqs[0])
            if req.abort_at == step:
                for seq in req.seqs:
                    sched.finish(seq, "abort")
        live = [s for r in requests for s in r.seqs if not s.is_finished]
        if not live and step > max((r.arrival for r in requests), default=0):
            break
        out = sched.schedule()
        check_step(sched, bm, out, live)
        for seq in sched.postprocess(out, runner.execute(out)):
            req = next(r for r in requests if r.name == seq.request_id)
            if seq not in req.seqs:
                req.seqs.append(seq)
        check_blocks(sched, bm, [s for r in requests for s in r.seqs if not s.is_finished])
    else:
        raise AssertionError(f"not done after {MAX_STEPS} steps: the scheduler is stuck")
    assert bm.num_used_blocks == 0
    assert bm.demotion is None or not (bm.demotion.pages or bm.demotion.open)
    for req in requests:
        check_request(req)
    return bm


def check_request(req: Request) -> None:
    aborted = req.abort_at is not None and any(s.finish_reason == "abort" for s in req.seqs)
    if not aborted:
        assert sorted(s.index for s in req.seqs) == list(range(req.n))
    for seq in req.seqs:
        expected = expected_output(req, seq.index)
        if aborted:
            assert seq.output_token_ids == expected[:len(seq.output_token_ids)]
        else:
            assert seq.output_token_ids == expected, f"{req.name}/{seq.index} lost or repeated"
        if req.prompt_logprobs and seq.num_output_tokens:     # scored before its first token
            assert [e and e.token_id for e in seq.prompt_logprobs] == [None] + req.prompt[1:]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    simulate(*workload)


def test_one_token_prompt_chunks_score_every_prompt_token():
    """The workload that lost prompt logprobs: budget 8, prompts of 56, 41, 79 and 27 tokens,
    all with prompt logprobs; once the first ones generate, the budget leaves one-token chunks
    in the middle of a prompt."""
    requests = [Request(f"r{i}", [1 + (7 * i + j) % (VOCAB - 1) for j in range(n)], 1, 8, True,
                        0, None, ignore_eos=True) for i, n in enumerate([56, 41, 79, 27])]
    simulate(dict(block_size=16, num_blocks=64, budget=8, max_num_seqs=4, chunked=True,
                  prefix_caching=True, watermark=1), requests)


def test_n_gt_1_under_memory_pressure_drops_copies_of_preempted_siblings():
    """Forks share a half-filled block; the cache is so small that siblings are preempted in
    the very step they copy-on-write. Their copies and tokens must not stay in the step."""
    requests = [Request(f"r{i}", [1 + (3 * i + j) % (VOCAB - 1) for j in range(6)], 3, 6,
                        i == 0, 0, None, ignore_eos=True) for i in range(3)]
    simulate(dict(block_size=4, num_blocks=6, budget=16, max_num_seqs=6, chunked=True,
                  prefix_caching=True, watermark=0), requests)


def test_forced_digest_collisions_never_serve_another_prefix(monkeypatch):
    """Every block digest equal: all prefixes land in one bucket, and a hit must still be
    confirmed token by token."""
    monkeypatch.setattr("kvslim.engine.sequence.block_hash", lambda parent, tokens: b"x")
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]
    requests = [Request(f"r{i}", prefix[:4] + [1 + i] * 4 + prefix, 1, 3, False, 2 * i, None)
                for i in range(4)]
    simulate(dict(block_size=4, num_blocks=16, budget=8, max_num_seqs=2, chunked=True,
                  prefix_caching=True, watermark=0), requests)


def test_demotion_under_pressure_keeps_every_invariant():
    """A cache far too small for its requests, forks and shared prefixes among them: demotion
    takes the place of most preemptions, and every read is still the sequence's own prefix."""
    def requests():
        return [Request(f"r{i}", [1 + (5 * i + j) % (VOCAB - 1) for j in range(10 + 3 * i)],
                        1 + i % 2, 8, i == 1, i, None, ignore_eos=True) for i in range(5)]
    config = dict(block_size=2, num_blocks=24, budget=12, max_num_seqs=6, chunked=True,
                  prefix_caching=True, watermark=0)
    preempting, demoting = requests(), requests()
    simulate(config, preempting)
    bm = simulate(config | {"demote": True}, demoting)
    preemptions = [sum(s.num_preemptions for r in reqs for s in r.seqs)
                   for reqs in (preempting, demoting)]
    assert bm.demotion.num_demoted > 0 and preemptions[1] < preemptions[0], preemptions
