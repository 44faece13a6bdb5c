"""`Sampler`: the next token of every sequence in a batch, each with its own parameters.

Order, per row: logit_bias -> penalties (repetition, presence, frequency) -> EOS/stop-token
ban while min_tokens is not reached -> the grammar's mask (structured outputs) -> greedy argmax, or temperature -> top_k -> top_p -> min_p
-> a draw. A request with a `seed` draws from its own generator, so its output does not depend on
what else is in the batch. Logprobs are those of the model's raw distribution."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.engine.sequence import Sequence, TokenLogprob
from kvslim.engine.speculative.verify import (TypicalAcceptance, pick_greedy, pick_sampled,
                                              pick_typical, verify_greedy, verify_sampled,
                                              verify_typical)
from kvslim.structured.manager import StructuredOutputManager, apply_bitmask


@dataclass
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None


@dataclass
class SampleRequest:
    """One row of logits and the sequence it belongs to; n > 1 parents draw several samples."""
    seq: Sequence
    num_samples: int = 1


class PenaltyState:
    """Per-sequence token statistics, built once and then updated one token at a time."""

    def __init__(self, seq: Sequence, vocab_size: int, device: torch.device):
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[torch.tensor(seq.prompt_token_ids, device=device, dtype=torch.long)] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if seq.output_token_ids:
            out = torch.tensor(seq.output_token_ids, device=device, dtype=torch.long)
            self.output_counts.index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
            self.seen[out] = True

    def add(self, token_id: int) -> None:
        self.seen[token_id] = True
        self.output_counts[token_id] += 1


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids, seed: int = 0,
                 structured: StructuredOutputManager | None = None,
                 typical_acceptance: TypicalAcceptance | None = None):
        """structured: the grammar masks of structured outputs; typical_acceptance: Medusa's
        typical acceptance for speculation (not exact; one-hot drafts only: a draft model's q
        keeps the exact rule)."""
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[tuple[str, int], torch.Generator] = {}
        self.penalties: dict[int, PenaltyState] = {}
        self.structured = structured
        self.typical_acceptance = typical_acceptance

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's state."""
        self.penalties.pop(seq.seq_id, None)
        self.generators.pop((seq.request_id, seq.index), None)
        if self.structured is not None:
            self.structured.release(seq)

    def start_masks(self, items: list[tuple[Sequence, list[int]]]) -> None:
        """Before the forward pass: begin the grammar masks of the rows this step samples."""
        if self.structured is not None:
            self.structured.start_masks(items)

    def _masks(self) -> dict[int, torch.Tensor]:
        return self.structured.masks() if self.structured is not None else {}

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]
                 ) -> list[list[SampleResult]]:
        """logits [len(requests), vocab] -> per request, its num_samples results."""
        if self._plain_greedy(requests):    # nothing to process: the argmax, the same bits
            return [[SampleResult(t, None)] for t in logits.argmax(dim=-1).tolist()]
        logits = logits.to(torch.float32, copy=True)        # processed in place below
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(r.seq.params.needs_logprob for r in requests) else None)
        self._apply_logit_bias(logits, requests)
        logits = self._apply_penalties(logits, requests)
        self._ban_until_min_tokens(logits, requests)
        masks = self._masks()
        for i, r in enumerate(requests):
            if r.seq.seq_id in masks:
                apply_bitmask(logits[i:i + 1], masks[r.seq.seq_id])
        results: list[list[SampleResult]] = [[] for _ in requests]
        beams = {i for i, r in enumerate(requests) if r.seq.params.use_beam_search}
        for i in beams:
            results[i] = self._beam_candidates(logits[i], raw_logprobs, i, requests[i].seq)
        rows = [i for i, r in enumerate(requests) if i not in beams
                for _ in range(r.num_samples)]
        samples = [(requests[i].seq, k) for i in dict.fromkeys(rows)
                   for k in range(requests[i].num_samples)]
        tokens = self._draw(logits[rows], samples).tolist() if rows else []
        for token, row, (seq, k) in zip(tokens, rows, samples):
            logprob = self._logprob(raw_logprobs, row, token, seq) if raw_logprobs is not None \
                else None
            results[row].append(SampleResult(token, logprob))
            if k == 0 and seq.seq_id in self.penalties:
                self.penalties[seq.seq_id].add(token)
        if masks:
            for r, res in zip(requests, results):
                if r.seq.seq_id in masks:
                    self.structured.accept(r.seq, [x.token_id for x in res], r.num_samples)
        return results

    def _plain_greedy(self, requests: list[SampleRequest]) -> bool:
        """Every request takes one greedy token whose logits nothing changes and whose logprob
        nobody asked for (a converting copy to float32 keeps the argmax and its ties)."""
        masked = self.structured is not None and bool(self._masks())
        return not masked and all(
            r.num_samples == 1 and p.greedy and not p.use_beam_search and not p.needs_logprob
            and not p.logit_bias and not p.uses_penalties
            and r.seq.num_output_tokens >= p.min_tokens
            for r in requests for p in (r.seq.params,))

    # ---- logits processing ---------------------------------------------------------------
    def _apply_logit_bias(self, logits: torch.Tensor, requests: list[SampleRequest]) -> None:
        for i, r in enumerate(requests):
            bias = r.seq.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), device=self.device)
                logits[i, ids] += torch.tensor(list(bias.values()), device=self.device)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.seq.params.uses_penalties]
        if not rows:
            return logits
        states = []
        for i in rows:
            seq = requests[i].seq
            if seq.params.use_beam_search:      # its tokens are chosen elsewhere: count anew
                self.penalties.pop(seq.seq_id, None)
            if seq.seq_id not in self.penalties:
                self.penalties[seq.seq_id] = PenaltyState(seq, self.vocab_size, self.device)
            states.append(self.penalties[seq.seq_id])
        params = [requests[i].seq.params for i in rows]
        seen = torch.stack([s.seen for s in states])
        counts = torch.stack([s.output_counts for s in states])
        logits[rows] = penalize(logits[rows], seen, counts, params)
        return logits

    def _ban_until_min_tokens(self, logits: torch.Tensor, requests: list[SampleRequest]) -> None:
        for i, r in enumerate(requests):
            p = r.seq.params
            if r.seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")

    def _beam_candidates(self, logits: torch.Tensor, raw_logprobs: torch.Tensor, row: int,
                         seq: Sequence) -> list[SampleResult]:
        """A beam's 2 x width best next tokens by processed logprob (no temperature)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        values, ids = logprobs.topk(min(2 * seq.params.num_sequences, logprobs.shape[-1]))
        top = self._logprob(raw_logprobs, row, int(ids[0]), seq).top
        return [SampleResult(t, TokenLogprob(t, v, top))
                for t, v in zip(ids.tolist(), values.tolist()) if v > float("-inf")]

    # ---- speculative decoding --------------------------------------------------------------
    def verify(self, logits: torch.Tensor, seq: Sequence, drafts: list[int],
               draft_probs: torch.Tensor | None = None) -> list[SampleResult]:
        """logits [k+1, vocab] of one sequence, row i after drafts[:i]: the accepted drafts and
        one more token (rules in speculative/verify.py), processed as plain sampling would."""
        logits = logits.to(torch.float32, copy=True)
        p = seq.params
        raw = torch.log_softmax(logits, dim=-1) if p.needs_logprob else None
        self._process_draft_rows(logits, seq, drafts)
        mask = self._masks().get(seq.seq_id)
        if mask is not None:
            apply_bitmask(logits, mask)
        if p.greedy:
            tokens = verify_greedy(logits, drafts)
        else:
            probs = filter_probs(logits / p.temperature, [p.top_k] * len(logits),
                                 [p.top_p] * len(logits), [p.min_p] * len(logits))
            generator = (self._generator(seq, 0) if p.seed is not None
                         else self.default_generator)
            if self.typical_acceptance is not None and draft_probs is None:
                tokens = verify_typical(probs, drafts, self.typical_acceptance, generator)
            else:
                tokens = verify_sampled(probs, drafts, draft_probs, generator)
        state = self.penalties.get(seq.seq_id)
        for token in tokens:
            if state is not None:
                state.add(token)
        if mask is not None:
            self.structured.accept(seq, tokens)
        return [SampleResult(t, None if raw is None else self._logprob(raw, i, t, seq))
                for i, t in enumerate(tokens)]

    def verify_tree(self, logits: torch.Tensor, seq: Sequence, drafts: list[int],
                    parents: list[int]) -> tuple[list[SampleResult], list[int]]:
        """logits [1 + len(drafts), vocab] of a tree of drafts (row 0 the sequence's last
        token, row i + 1 draft i, parents as a TokenProposals tree's): the tokens the target
        takes walking down from the root, and the rows they were drawn from (the accepted
        path). Each row on the path is processed as plain sampling would process it after the
        path's drafts before it (bias, penalties, min_tokens); grammar-constrained sequences
        verify chains only (SpeculativeDecoder)."""
        logits = logits.to(torch.float32)
        p = seq.params
        raw = torch.log_softmax(logits, dim=-1) if p.needs_logprob else None
        children: dict[int, list[tuple[int, int]]] = {}
        for i, (parent, draft) in enumerate(zip(parents, drafts)):
            children.setdefault(parent + 1, []).append((i + 1, draft))
        generator = self._generator(seq, 0) if p.seed is not None else self.default_generator
        path, tokens = [0], []
        while True:
            rows = logits[path].clone()
            self._process_draft_rows(rows, seq, tokens)
            row, kids = rows[-1], children.get(path[-1], [])
            if p.greedy:
                token, child = pick_greedy(row, kids)
            else:
                probs = filter_probs(row[None] / p.temperature, [p.top_k], [p.top_p],
                                     [p.min_p])[0]
                token, child = (pick_sampled(probs, kids, generator)
                                if self.typical_acceptance is None
                                else pick_typical(probs, kids, self.typical_acceptance,
                                                  generator))
            tokens.append(token)
            if child is None:
                break
            path.append(child)
        state = self.penalties.get(seq.seq_id)
        for token in tokens if state is not None else ():
            state.add(token)
        return [SampleResult(t, None if raw is None else self._logprob(raw, row, t, seq))
                for row, t in zip(path, tokens)], path

    def _process_draft_rows(self, logits: torch.Tensor, seq: Sequence, drafts: list[int]
                            ) -> None:
        """Bias, penalties and the min_tokens ban for each row as if the drafts before it had
        been sampled: the distributions plain decoding would have used."""
        state = None
        if seq.params.uses_penalties:
            if seq.seq_id not in self.penalties:
                self.penalties[seq.seq_id] = PenaltyState(seq, self.vocab_size, self.device)
            state = self.penalties[seq.seq_id]
        process_rows(logits, seq, drafts, state, self.eos_token_ids)

    # ---- drawing -------------------------------------------------------------------------
    def _draw(self, logits: torch.Tensor, samples: list[tuple[Sequence, int]]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        if all(s.params.greedy for s, _ in samples):      # decided on the host: no sync
            return tokens
        greedy = torch.tensor([s.params.greedy for s, _ in samples], device=self.device)
        params = [s.params for s, _ in samples]
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                             device=self.device)[:, None]
        probs = filter_probs(logits / temps,
                             top_k=[p.top_k for p in params], top_p=[p.top_p for p in params],
                             min_p=[p.min_p for p in params])
        noise = torch.empty_like(probs)
        unseeded = [i for i, (s, _) in enumerate(samples) if s.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=self.device
                                          ).exponential_(generator=self.default_generator)
        for i, (seq, k) in enumerate(samples):
            if seq.params.seed is not None:
                noise[i].exponential_(generator=self._generator(seq, k))
        # argmax(p / E) with E ~ Exp(1) is an exact draw from p (the exponential race).
        drawn = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, tokens, drawn)

    def _generator(self, seq: Sequence, k: int) -> torch.Generator:
        index = seq.index + k
        key = (seq.request_id, index)
        if key not in self.generators:
            seed = seq.params.seed if index == 0 else hash((seq.params.seed, index)) & (2**62 - 1)
            self.generators[key] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[key]

    @staticmethod
    def _logprob(logprobs: torch.Tensor, row: int, token: int, seq: Sequence) -> TokenLogprob:
        n = seq.params.logprobs or 0
        top = []
        if n:
            values, ids = logprobs[row].topk(n)
            top = list(zip(ids.tolist(), values.tolist()))
        return TokenLogprob(token, float(logprobs[row, token]), top)


def process_rows(logits: torch.Tensor, seq: Sequence, drafts: list[int],
                 state: PenaltyState | None, eos_token_ids: list[int]) -> None:
    """In place, for rows 0..k of one sequence (row i after drafts[:i]): logit_bias, the
    penalties from `state` (the sequence's tokens so far) plus the drafts before each row, and
    the stop-token ban while min_tokens is not reached. Used by verification and by a draft
    model, so that p and q are processed alike."""
    p = seq.params
    if p.logit_bias:
        logits[:, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()),
                                                      device=logits.device)
    if p.uses_penalties and state is not None:
        seen, counts = state.seen.clone(), state.output_counts.clone()
        for i in range(len(logits)):
            logits[i] = penalize(logits[i:i + 1], seen[None], counts[None], [p])[0]
            if i < len(drafts):
                seen[drafts[i]] = True
                counts[drafts[i]] += 1
    banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
    for i in range(len(logits)):
        if seq.num_output_tokens + i < p.min_tokens and banned:
            logits[i, banned] = float("-inf")


def penalize(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, params) -> torch.Tensor:
    """Repetition (on every seen token), presence and frequency (on output tokens) penalties
    for rows of logits, one SamplingParams per row."""
    device = logits.device
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - pres * (counts > 0) - freq * counts


def filter_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
                 ) -> torch.Tensor:
    """Probabilities after per-row top_k (0 = off), top_p (1 = off) and min_p (0 = off)."""
    device = logits.device
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        # top_k beyond the vocabulary is "off"; clamping also keeps huge ints out of int64.
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)[:, None]
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= k
        probs_sorted = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        p = torch.tensor(top_p, device=device)[:, None]
        drop |= mass_before >= p          # keep the smallest prefix whose mass reaches top_p
        drop[:, 0] = False
        logits = torch.empty_like(logits).scatter_(
            -1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    if any(m > 0 for m in min_p):
        m = torch.tensor(min_p, device=device)[:, None]
        probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
