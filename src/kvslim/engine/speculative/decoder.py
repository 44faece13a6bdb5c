"""`SpeculativeDecoder`: the engine's side of speculation. Before a step it asks the proposer
for drafts for each generating sequence (unless the batch is too large or the sequence has
backed off); after the step it counts what the target accepted."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvslim.engine.scheduler import draft_tree_rows
from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.draft import DraftModelProposer
from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.engine.speculative.eagle import EagleProposer
from kvslim.engine.speculative.lookahead import LookaheadProposer
from kvslim.engine.speculative.medusa import MedusaProposer
from kvslim.engine.speculative.ngram import NgramProposer
from kvslim.errors import KvslimError


MAX_DOUBLINGS = 10


@dataclass
class SpecDecodeStats:
    num_verifications: int = 0           # (sequence, step) pairs that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    num_proposals: int = 0               # steps that asked the proposer for drafts
    # Trees: per node of the configured tree, how often it was fed and how often it lay on
    # the accepted path (what a tree's shape is chosen from: benchmarks/tree_shape.py), and
    # the accepted tokens off the proposer's best chain (what the other candidates added).
    drafted_per_node: list[int] = field(default_factory=list)
    accepted_per_node: list[int] = field(default_factory=list)
    num_accepted_off_chain: int = 0
    propose_seconds: float = 0.0         # wall time spent drafting in them

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: accepted drafts plus the target's
        own token (1.0 would be plain decoding)."""
        if not self.num_verifications:
            return 0.0
        return 1 + self.num_accepted_tokens / self.num_verifications

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


@dataclass
class _Backoff:
    drafted: int = 0
    accepted: int = 0
    resume_at_step: int = 0
    pauses: int = 0                      # low-acceptance windows in a row


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, draft: DraftModelProposer | None = None,
                 fed: MedusaProposer | EagleProposer | LookaheadProposer | None = None,
                 verifies_chains_only: Callable[[Sequence], bool] = lambda seq: False):
        """draft: the draft model's proposer (method "draft"); fed: a proposer the runner
        feeds from the target's own forward pass, heads on its hidden states (methods
        "medusa" and "eagle", `learned`) or lookahead's window on its rows' greedy tokens
        (method "lookahead"); verifies_chains_only: the sequences that take a tree's best
        chain instead of the tree (those whose grammar masks are computed along a chain)."""
        if config.method == "draft" and draft is None:
            raise KvslimError("speculative method 'draft' needs its draft model loaded")
        if config.method in ("medusa", "eagle", "lookahead") and fed is None:
            raise KvslimError(f"speculative method {config.method!r} needs its proposer built")
        self.config = config
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                   config.num_speculative_tokens)
        self.draft = draft
        self.learned = fed if config.method in ("medusa", "eagle") else None
        self.lookahead = fed if config.method == "lookahead" else None
        self.reset_stats()
        self.draft_probs: dict[int, torch.Tensor] = {}      # seq_id -> q of its drafts
        # seq_id -> (tokens, a tree's parents or None): this step's proposals, until taken
        self.proposals: dict[int, tuple[list[int], list[int] | None]] = {}
        self._backoff: dict[int, _Backoff] = {}
        self._engine_wide = _Backoff()       # the same windows over every sequence's drafts
        self._step = 0
        self.verifies_chains_only = verifies_chains_only

    def reset_stats(self) -> None:
        """Counts from zero (a benchmark leaves its warm-up out)."""
        k = self.config.num_speculative_tokens
        nodes = 0 if self.config.tree is None else len(self.config.tree.paths)
        self.stats = SpecDecodeStats(drafted_per_position=[0] * k, accepted_per_position=[0] * k,
                                     drafted_per_node=[0] * nodes, accepted_per_node=[0] * nodes)

    def propose(self, running: list[Sequence]) -> None:
        """Propose tokens (and, for a draft model, draft_probs) for the generating sequences
        that should speculate this step; the scheduler `take`s them."""
        self._step += 1
        self.draft_probs = {}
        self.proposals = {}
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        seqs = [seq for seq in running if self._speculates(seq)]
        if not seqs:
            return
        start = time.perf_counter()
        self._propose(seqs)
        self.stats.num_proposals += 1
        self.stats.propose_seconds += time.perf_counter() - start

    def _propose(self, seqs: list[Sequence]) -> None:
        by_id = {seq.seq_id: seq for seq in seqs}
        room = [self.config.num_speculative_tokens if seq.params.max_tokens is None
                else min(self.config.num_speculative_tokens,
                         seq.params.max_tokens - seq.num_output_tokens - 1) for seq in seqs]
        if self.lookahead is not None:
            self.proposals.update(self.lookahead.propose(seqs, room, self.verifies_chains_only))
            return
        if self.learned is not None:
            tree = self.config.draft_tree
            for seq_id, guesses in self.learned.propose(seqs, room, tree.width).items():
                seq = by_id[seq_id]
                if tree.is_chain or self.verifies_chains_only(seq):
                    self.proposals[seq_id] = ([ranked[0] for ranked in guesses], None)
                else:
                    self.proposals[seq_id] = tree.drafts(guesses)
            return
        if self.draft is None:
            for seq, k in zip(seqs, room):
                self.proposals[seq.seq_id] = (self.ngram.propose(seq.token_ids, k), None)
            return
        drafts = self.draft.propose(seqs, room)
        for seq in seqs:
            if seq.seq_id in drafts:
                tokens, self.draft_probs[seq.seq_id] = drafts[seq.seq_id]
                self.proposals[seq.seq_id] = (tokens, None)

    def _speculates(self, seq: Sequence) -> bool:
        if seq.num_uncomputed_tokens != 1 or seq.fork_pending or seq.params.use_beam_search:
            return False
        backoff = self._backoff.get(seq.seq_id)
        if backoff is None and self._engine_wide.pauses:
            # A new sequence starts where the proposer stands engine-wide: when it has not
            # been paying off, it waits instead of spending its own probing window first.
            backoff = self._backoff[seq.seq_id] = _Backoff(pauses=self._engine_wide.pauses)
            backoff.resume_at_step = self._step + self._pause(backoff.pauses - 1)
        return backoff is None or backoff.resume_at_step <= self._step

    def _pause(self, pauses_before: int) -> int:
        return self.config.backoff_steps * 2 ** min(pauses_before, MAX_DOUBLINGS)

    def record(self, seq: Sequence, drafts: list[int], results: list,
               parents: list[int] | None = None) -> None:
        """One sequence's verification: its drafts (a tree's with their parents) and the
        tokens the target returned (the accepted drafts, then its own token). Positions count
        depths: a tree drafts every one of its depths once, however many nodes it has there."""
        accepted = len(results) - 1
        depth = len(drafts) if parents is None else max(draft_tree_rows(parents).depths)
        s = self.stats
        s.num_verifications += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += accepted
        for i in range(depth):
            s.drafted_per_position[i] += 1
            s.accepted_per_position[i] += i < accepted
        if parents is not None and self.config.tree is not None:     # a configured tree's
            self._record_nodes(drafts, parents, results)
        self._update_backoff(seq, depth, accepted)

    def _record_nodes(self, drafts: list[int], parents: list[int], results: list) -> None:
        """The accepted path through the tree, found from the tokens (siblings draft distinct
        tokens); the drafts are the tree's first nodes (a cut tree has fewer)."""
        s, paths = self.stats, self.config.tree.paths
        for i in range(len(drafts)):
            s.drafted_per_node[i] += 1
        node = -1
        for result in results[:-1]:
            node = next(i for i, p in enumerate(parents)
                        if p == node and drafts[i] == result.token_id)
            s.accepted_per_node[node] += 1
            s.num_accepted_off_chain += any(paths[node])

    def _update_backoff(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A sequence whose acceptance over the last `backoff_window` drafted tokens is below
        `backoff_acceptance` stops proposing for `backoff_steps` steps, twice as long after
        each further such window in a row (a proposer that never helps costs one probing
        window per doubling, not one per pause)."""
        cfg = self.config
        if cfg.backoff_acceptance <= 0:
            return
        for b in (self._backoff.setdefault(seq.seq_id, _Backoff()), self._engine_wide):
            b.drafted += drafted
            b.accepted += accepted
            if b.drafted < cfg.backoff_window:
                continue
            if b.accepted < cfg.backoff_acceptance * b.drafted:
                b.resume_at_step = self._step + self._pause(b.pauses) + 1
                b.pauses += 1
            else:
                b.pauses = 0
            b.drafted = b.accepted = 0

    def take(self, seq: Sequence) -> tuple[list[int], list[int] | None]:
        """The scheduler's side (scheduler.py's TokenProposals): this step's proposal for
        `seq`, forgotten once taken."""
        return self.proposals.pop(seq.seq_id, ([], None))

    def release(self, seq_ids: list[int]) -> None:
        """Forget finished or preempted sequences (a draft model frees their draft K/V)."""
        for seq_id in seq_ids:
            self._backoff.pop(seq_id, None)
            self.proposals.pop(seq_id, None)
        for proposer in (self.draft, self.learned, self.lookahead):
            if proposer is not None:
                proposer.release(seq_ids)

