"""`Scheduler`: which sequences run this step and how many tokens each. Plain Python, no torch.

Uniform token scheduling, as in vLLM v1: a step gives each scheduled sequence a number of tokens
to compute (its next prompt chunk, its one new token, or a recompute after preemption) and
nothing else. Whether a query row samples or scores prompt tokens follows from the sequence's
state and the positions the step covers, never from how many tokens it got.

Each step first serves the running sequences (those with one token left to compute first: they
are generating), then admits waiting sequences first-come-first-served while blocks,
`max_num_seqs` and the token budget allow. When blocks run out, the newest running sequence is
preempted: its blocks are freed, its place in this step (tokens and pending block copies) is
undone, and its tokens are recomputed later (the prefix cache usually returns most of them).
Under `--kv-pressure demote` the scheduler first takes bytes back from precision: it demotes
the oldest blocks of the longest-running sequences to int8 (engine/kv_demotion.py) until the
step fits, for a running sequence's next tokens and for a waiting one's admission alike, and
preempts only when nothing is left to demote.

A `LengthSwitch` (engine/long_rope.py: LongRoPE's) names a length past which a sequence must be
computed again: a sequence that grows past it is recomputed as a preempted one is, a longer one
is computed so from the start, and drafts stop at it."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from kvslim.attention.tree import TreeRows
from kvslim.engine.block_manager import BlockManager
from kvslim.engine.long_rope import LengthSwitch
from kvslim.engine.sequence import Sequence, SequenceStatus


class TokenProposals(Protocol):
    """Tokens proposed for a sequence, to be verified after its last one (speculative
    decoding's drafts: engine/speculative/decoder.py)."""

    def take(self, seq: Sequence) -> tuple[list[int], list[int] | None]:
        """The tokens proposed for `seq` this step (forgotten once taken), and for a tree each
        one's parent (an index into them; -1: the sequence's last token); None: a chain."""


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int                      # tokens whose K/V are computed this step
    sample: bool                         # the step reaches the sequence's last token
    num_samples: int = 1                 # an n > 1 parent draws all n first tokens at once
    start: int = 0                       # position of the first of them
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write, before
    # Speculative tokens fed after the sequence's last token, to be verified by this step,
    # and for a tree each one's parent (see TokenProposals; None: a chain).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_parents: list[int] | None = None
    # Per KV-cache group, the first block-table entry the block manager changed since the
    # runner last read the table (`BlockManager.take_changes`); None: every entry.
    table_changes: list[int] | None = None

    @cached_property
    def tree(self) -> TreeRows | None:
        """The step's rows as a tree (row 0 the sequence's last token), for a tree of drafts;
        built once, read by the runner and the attention metadata."""
        if self.draft_parents is None:
            return None
        return draft_tree_rows(self.draft_parents)

    @property
    def input_token_ids(self) -> list[int]:
        """The tokens the model reads: the sequence's own, then any drafts."""
        own = self.num_tokens - len(self.draft_token_ids)
        return self.seq.token_ids[self.start:self.start + own] + self.draft_token_ids

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions whose logits score the next prompt token, among those computed this step
        (positions scored before a preemption are not scored again)."""
        seq = self.seq
        if seq.params.prompt_logprobs is None:
            return range(0)
        first = max(self.start, len(seq.prompt_logprobs) - 1)
        return range(first, min(self.start + self.num_tokens, seq.num_prompt_tokens - 1))


def draft_tree_rows(parents: list[int]) -> TreeRows:
    return TreeRows((-1, *(p + 1 for p in parents)))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)   # runner may drop their state
    # Blocks demoted to int8 (engine/kv_demotion.py): (float32 block, int8 block), done first.
    demotions: list[tuple[int, int]] = field(default_factory=list)

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return [copy for entry in self.scheduled for copy in entry.block_copies]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_ids: list[int] | tuple[int, ...] = (),
                 enable_chunked_prefill: bool = True, length_switch: LengthSwitch | None = None,
                 proposals: TokenProposals | None = None, max_loras: int | None = None):
        """max_loras: the most distinct LoRA adapters running at once (None: no adapters)."""
        self.bm = block_manager
        self.max_loras = max_loras
        self.length_switch = length_switch
        self.proposals = proposals
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._released: list[int] = []

    # ---- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self._outgrew(seq):
            self.length_switch.switch(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop condition, abort) and free its blocks, wherever it is."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        self._released.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it waits at the front, to be computed again."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.held_samples = []
        self.waiting.appendleft(seq)
        self._released.append(seq.seq_id)

    def _outgrew(self, seq: Sequence) -> bool:
        return self.length_switch is not None and self.length_switch.outgrew(seq)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        # Generating sequences (one token left to compute) first, then the rest; oldest first.
        order = sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1)
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:     # preempted earlier in this loop
                continue
            if seq.num_uncomputed_tokens == 0:      # its samples held for its strategy
                continue
            drafts, parents = self._take_drafts(seq, budget)
            n = min(seq.num_uncomputed_tokens, budget) + len(drafts)
            entry, refund = self._reserve(seq, n, out, drafts, parents)
            budget += refund
            if entry is None:
                continue
            out.scheduled.append(entry)
            budget -= n
        if self.num_preemptions == preemptions_before:   # no room was short: admit new work
            self._admit(out, budget)
        for entry in out.scheduled:                     # the step's tables, as they now are
            entry.table_changes = self.bm.take_changes(entry.seq)
        if out.scheduled and self.bm.demotion is not None:   # else they wait for a step
            out.demotions = self.bm.demotion.take_copies()
        out.released_seq_ids, self._released = self._released, []
        return out

    def _take_drafts(self, seq: Sequence, budget: int) -> tuple[list[int], list[int] | None]:
        """The sequence's proposed tokens (and a tree's parents) to verify this step: only
        while it generates, as deep as max_tokens allows, as many as the token budget allows,
        and only when their slots are free without preempting anyone (speculation never costs
        another sequence its place)."""
        drafts, parents = self.proposals.take(seq) if self.proposals is not None else ([], None)
        if not drafts or seq.num_uncomputed_tokens != 1 or seq.fork_pending:
            return [], None
        depth = len(drafts)
        if seq.params.max_tokens is not None:
            depth = min(depth, seq.params.max_tokens - seq.num_output_tokens - 1)
        room = self.length_switch.room(seq) if self.length_switch is not None else None
        if room is not None:
            depth = min(depth, room)
        if parents is None:
            keep = max(0, min(depth, budget - 1))
        else:       # a tree lists its drafts by depth: what is cut is a deeper part
            depths = draft_tree_rows(parents).depths[1:]
            keep = max(0, min(sum(d <= depth for d in depths), budget - 1))
            parents = parents[:keep]
        drafts = drafts[:keep]
        if not drafts or not self.bm.can_append(seq, 1 + len(drafts)):
            return [], None
        return drafts, parents

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, drafts: list[int] = (),
                 parents: list[int] | None = None) -> tuple[ScheduledSequence | None, int]:
        """Blocks for `n` more tokens of `seq`, preempting the newest sequences if needed.
        Returns its entry (None when `seq` itself had to be preempted) and the tokens that
        preempted sequences had been given this step, which go back to the budget."""
        refund = 0
        while not self.bm.can_append(seq, n):
            if self.bm.demote(self.running):
                continue
            victim = self.running[-1]
            self._preempt(victim)
            # Undo the victim's place this step: its tokens go back to the budget, and its
            # pending copies are dropped (their destination blocks were just freed).
            refund += sum(e.num_tokens for e in out.scheduled if e.seq is victim)
            out.scheduled[:] = [e for e in out.scheduled if e.seq is not victim]
            if victim is seq:
                return None, refund
        copies = self.bm.append_slots(seq, n)
        return self._entry(seq, n, copies, list(drafts), parents), refund

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._num_seq_slots(self.running) + self._num_seq_slots([seq]) > self.max_num_seqs:
                break
            # Without chunked prefill a prompt runs whole; a recompute may still be chunked
            # (it could outgrow the budget while generating, and must not wait forever).
            if not self.enable_chunked_prefill and not seq.num_output_tokens \
                    and seq.num_tokens > budget:
                break
            if not self._room_for(seq, budget) or self._lora_slots_full(seq):
                break
            self.waiting.popleft()
            self.bm.allocate(seq, num_new_tokens=budget)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(self._entry(seq, n, []))
            budget -= n

    def _room_for(self, seq: Sequence, budget: int) -> bool:
        """Whether a waiting sequence's first chunk fits, after demoting running sequences'
        blocks where that makes room (only when demoting all it could would be enough: a
        demoted block never goes back up)."""
        keep = bool(self.running)
        if self.bm.demotion is not None:
            short = self.bm.allocation_shortfall(seq, keep, budget)
            if short > 0 and self.bm.demotion.room(self.bm, self.running) >= short:
                while self.bm.allocation_shortfall(seq, keep, budget) > 0 \
                        and self.bm.demote(self.running):
                    pass
        return self.bm.can_allocate(seq, keep_watermark=keep, num_new_tokens=budget)

    def _lora_slots_full(self, seq: Sequence) -> bool:
        """Whether admitting `seq` would run more distinct adapters than there are slots."""
        if not seq.lora_id:
            return False
        running = {s.lora_id for s in self.running} - {0}
        return seq.lora_id not in running and len(running) >= self.max_loras

    @staticmethod
    def _num_seq_slots(seqs: list[Sequence]) -> int:
        """Batch rows the sequences take, counting the siblings an n > 1 parent forks into
        once its prompt is done (possibly several chunked steps after admission), and the
        sequences a search strategy's first one will fork into."""
        return sum(s.params.num_sequences if s.fork_pending or (
            s.params.holds_samples and not s.num_output_tokens) else 1 for s in seqs)

    @staticmethod
    def _entry(seq: Sequence, n: int, copies: list[tuple[int, int]],
               drafts: list[int] | None = None, parents: list[int] | None = None
               ) -> ScheduledSequence:
        start = seq.num_computed_tokens
        sample = start + n - len(drafts or ()) == seq.num_tokens
        num_samples = seq.params.num_sequences if sample and seq.fork_pending else 1
        return ScheduledSequence(seq, n, sample, num_samples, start, copies, drafts or [],
                                 parents)

    # ---- after the model ran -------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[int, list]) -> list[Sequence]:
        """Advance computed tokens, cache full blocks, append sampled tokens (`sampled` maps a
        seq_id to its SampleResults), fork n > 1 parents, apply token-level stops. Returns the
        sequences that received a token this step."""
        now = time.monotonic()
        updated = []
        for entry in out.scheduled:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if entry.draft_token_ids:
                self._accept(seq, sampled[seq.seq_id], now)
                updated.append(seq)
                continue
            seq.num_computed_tokens += entry.num_tokens
            self.bm.cache_computed_blocks(seq)
            self.bm.release_out_of_window(seq)
            if not entry.sample:
                continue
            results = sampled[seq.seq_id]
            if seq.params.holds_samples:            # its search strategy picks the tokens
                seq.held_samples = results
                continue
            family = [seq] + (self._fork(seq) if seq.fork_pending else [])
            for member, result in zip(family, results):
                member.append_sample(result, now)
                updated.append(member)
                reason = self._token_stop(member)
                if reason:
                    self.finish(member, reason)
        for seq in updated:
            if seq.status is SequenceStatus.RUNNING and self._outgrew(seq):
                self.length_switch.switch(seq)
                self._requeue(seq)
        return updated

    def _accept(self, seq: Sequence, results: list, now: float) -> None:
        """After verification: `results` are the accepted drafts, then the target's own next
        token. The fed token and the accepted drafts now have valid K/V; the slots of rejected
        drafts are released. Tokens are appended one at a time, so a stop (EOS, a stop token,
        max_tokens) ends the sequence exactly where plain decoding would have."""
        seq.num_computed_tokens += len(results)
        for result in results:
            seq.append_sample(result, now)
            reason = self._token_stop(seq)
            if reason:
                self.finish(seq, reason)
                return
        self.bm.trim(seq, seq.num_computed_tokens)
        self.bm.cache_computed_blocks(seq)
        self.bm.release_out_of_window(seq)

    def fork_sibling(self, parent: Sequence, index: int) -> Sequence:
        """A sibling of a running sequence (a search strategy's new candidate): the parent's
        tokens and blocks (shared copy-on-write), running right after it."""
        child = parent.fork(index)
        self.bm.fork(parent, child)
        self.running.insert(self.running.index(parent) + 1, child)
        return child

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the siblings share every block of the computed prompt (copy-on-write)."""
        parent.fork_pending = False
        children = []
        at = self.running.index(parent) + 1
        for i in range(1, parent.params.num_sequences):
            child = parent.fork(i)
            self.bm.fork(parent, child)
            self.running.insert(at + len(children), child)
            children.append(child)
        return children

    def _token_stop(self, seq: Sequence) -> str | None:
        p = seq.params
        token = seq.last_token
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length"
        return None
