"""`SpeculativeDecoder`: the engine's side of speculation. Before a step it asks the proposer
for drafts for each generating sequence (unless the batch is too large or the sequence has
backed off); after the step it counts what the target accepted."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.engine.speculative.ngram import NgramProposer
from kvslim.errors import KvslimError


@dataclass
class SpecDecodeStats:
    num_verifications: int = 0           # (sequence, step) pairs that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

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


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig):
        if config.method != "ngram":
            raise KvslimError(f"speculative method {config.method!r} is not available in this "
                              "engine yet; use 'ngram'")
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                      config.num_speculative_tokens)
        k = config.num_speculative_tokens
        self.stats = SpecDecodeStats(drafted_per_position=[0] * k, accepted_per_position=[0] * k)
        self._backoff: dict[int, _Backoff] = {}
        self._step = 0

    def propose(self, running: list[Sequence]) -> None:
        """Set spec_token_ids on the generating sequences that should speculate this step."""
        self._step += 1
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or seq.fork_pending:
                continue
            backoff = self._backoff.get(seq.seq_id)
            if backoff is not None and backoff.resume_at_step > self._step:
                continue
            remaining = None
            if seq.params.max_tokens is not None:
                remaining = seq.params.max_tokens - seq.num_output_tokens - 1
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, remaining)

    def record(self, seq: Sequence, drafts: list[int], results: list) -> None:
        """One sequence's verification: its drafts and the tokens the target returned (the
        accepted drafts, then its own token)."""
        accepted = len(results) - 1
        s = self.stats
        s.num_verifications += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += accepted
        for i in range(len(drafts)):
            s.drafted_per_position[i] += 1
            s.accepted_per_position[i] += i < accepted
        self._update_backoff(seq, len(drafts), accepted)

    def _update_backoff(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A sequence whose acceptance over the last `backoff_window` drafted tokens is below
        `backoff_acceptance` stops proposing for `backoff_steps` steps."""
        cfg = self.config
        if cfg.backoff_acceptance <= 0:
            return
        b = self._backoff.setdefault(seq.seq_id, _Backoff())
        b.drafted += drafted
        b.accepted += accepted
        if b.drafted >= cfg.backoff_window:
            if b.accepted < cfg.backoff_acceptance * b.drafted:
                b.resume_at_step = self._step + cfg.backoff_steps + 1
            b.drafted = b.accepted = 0

    def release(self, seq_id: int) -> None:
        self._backoff.pop(seq_id, None)
