"""Beam search in the batched engine. A request's live beams are ordinary sequences; each step
the sampler gives every beam its 2 x width best next tokens (processed logprobs: logit_bias,
penalties, the min_tokens ban), and once every live beam of the request has its candidates the
request advances at once, as transformers' beam search does:

- candidates ranked by cumulative logprob; an end token (EOS or a stop token) among the first
  `width` closes a hypothesis, scored cumulative logprob / length ** length_penalty (length:
  the generated tokens before the end token);
- the best `width` other candidates are the next beams: a parent chosen k times goes on as one
  of them and forks k - 1 siblings that share its KV blocks copy-on-write (BlockManager.fork);
  a parent chosen by none dies and its blocks are freed;
- early_stopping True: done with `width` hypotheses; False: also when the best live beam, scored
  at its current length, cannot beat the worst kept hypothesis; "never": scored at max_tokens
  (length_penalty > 0). At max_tokens the live beams become hypotheses too.

The n best hypotheses are the request's completions. A beam preempted while its siblings wait
is recomputed; the request advances when it is back (Scheduler skips a sequence with nothing
to compute)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvslim.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvslim.engine.sequence import Sequence, TokenLogprob


@dataclass
class Hypothesis:
    token_ids: list[int]                 # generated tokens, the end token included
    cumulative_logprob: float
    score: float
    finish_reason: str                   # "stop" or "length"
    logprobs: list[TokenLogprob]


@dataclass
class BeamGroup:
    state: object                        # the request's RequestState (output_processor.py)
    width: int
    hypotheses: list[Hypothesis] = field(default_factory=list)
    next_index: int = 1

    @property
    def params(self):
        return self.state.params

    @property
    def beams(self) -> list[Sequence]:
        return self.state.seqs


def beam_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    return cumulative_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    def __init__(self, scheduler, eos_token_ids: list[int]):
        self.scheduler = scheduler
        # Beams dropped since the last `take_dropped`: the engine frees their per-sequence
        # state (handed back, not called back, so no cycle ties this object to the engine).
        self.dropped: list[Sequence] = []
        self.eos_token_ids = frozenset(eos_token_ids)
        self.groups: dict[str, BeamGroup] = {}

    def add(self, state) -> None:
        self.groups[state.request_id] = BeamGroup(state, state.params.num_sequences)

    def forget(self, request_id: str) -> None:
        self.groups.pop(request_id, None)

    def take_dropped(self) -> list[Sequence]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def advance(self) -> list[str]:
        """Advance every request whose live beams all have candidates; returns the requests
        that are done (their hypotheses final, their beams still to be freed)."""
        done = []
        for request_id, group in self.groups.items():
            if group.beams and all(b.held_samples for b in group.beams):
                if self._step(group):
                    done.append(request_id)
        return done

    # ---- one step of one request ---------------------------------------------------------
    def _step(self, group: BeamGroup) -> bool:
        p, width = group.params, group.width
        ranked = sorted(((b.cumulative_logprob + r.logprob.logprob, i, k, r)
                         for i, b in enumerate(group.beams)
                         for k, r in enumerate(b.held_samples)),
                        key=lambda c: (-c[0], c[1], c[2]))
        chosen: list[tuple[Sequence, object]] = []
        for rank, (_, i, _, result) in enumerate(ranked):
            beam = group.beams[i]
            if self._ends(beam, result.token_id):
                if rank < width:
                    self._keep(group, beam, result, "stop")
                continue
            chosen.append((beam, result))
            if len(chosen) == width:
                break
        for beam in group.beams:
            beam.held_samples = []
        if not chosen:
            return True
        best = chosen[0][0].cumulative_logprob + chosen[0][1].logprob.logprob
        length = chosen[0][0].num_output_tokens + 1
        if self._finished(group, best, length):
            return True
        self._continue(group, chosen)
        if p.max_tokens is not None and length >= p.max_tokens:
            for beam in group.beams:
                self._keep(group, beam, None, "length")
            return True
        return False

    def _ends(self, beam: Sequence, token: int) -> bool:
        p = beam.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)

    def _keep(self, group: BeamGroup, beam: Sequence, result, reason: str) -> None:
        """A finished hypothesis: `beam`'s tokens, then `result`'s end token if any."""
        tokens = beam.output_token_ids + ([result.token_id] if result is not None else [])
        cum = beam.cumulative_logprob + (result.logprob.logprob if result is not None else 0.0)
        length = beam.num_output_tokens
        logprobs = list(beam.logprobs) + ([result.logprob] if result is not None
                                          and beam.params.logprobs is not None else [])
        group.hypotheses.append(Hypothesis(tokens, cum, beam_score(cum, length,
                                                                   group.params.length_penalty),
                                           reason, logprobs))
        group.hypotheses.sort(key=lambda h: -h.score)
        del group.hypotheses[group.width:]

    def _finished(self, group: BeamGroup, best_cumulative: float, length: int) -> bool:
        p = group.params
        if len(group.hypotheses) < group.width:
            return False
        if p.early_stopping is True:
            return True
        if p.early_stopping == "never" and p.length_penalty > 0 and p.max_tokens is not None:
            length = p.max_tokens
        best_possible = beam_score(best_cumulative, length, p.length_penalty)
        return group.hypotheses[-1].score >= best_possible

    def _continue(self, group: BeamGroup, chosen: list[tuple[Sequence, object]]) -> None:
        """The chosen candidates become the live beams: forks for parents chosen more than
        once (before the parent takes its own token), the unchosen parents freed."""
        now = time.monotonic()
        by_parent: dict[int, list] = {}
        for beam, result in chosen:
            by_parent.setdefault(beam.seq_id, []).append(result)
        beams = []
        for parent in list(group.beams):
            results = by_parent.get(parent.seq_id)
            if not results:
                self.scheduler.finish(parent, "abort")
                self.dropped.append(parent)
                continue
            children = []
            for _ in results[1:]:
                child = self.scheduler.fork_sibling(parent, group.next_index)
                child.cumulative_logprob = parent.cumulative_logprob
                child.logprobs = list(parent.logprobs)
                child.first_token_time = parent.first_token_time
                children.append(child)
                group.next_index += 1
            for seq, result in zip([parent] + children, results):
                seq.append_sample(result, now)
                beams.append(seq)
        group.state.seqs[:] = beams

    # ---- the request's output ------------------------------------------------------------
    def output(self, request_id: str, tokenizer) -> RequestOutput:
        group = self.groups.pop(request_id)
        state, p = group.state, group.params
        completions = []
        for i, h in enumerate(group.hypotheses[:p.n]):
            completions.append(CompletionOutput(
                index=i, text=tokenizer.decode(h.token_ids, p.skip_special_tokens),
                token_ids=h.token_ids, finish_reason=h.finish_reason,
                logprobs=h.logprobs if p.logprobs is not None else None,
                cumulative_logprob=h.cumulative_logprob))
        metrics = RequestMetrics(arrival_time=min(s.arrival_time for s in state.seqs)
                                 if state.seqs else time.monotonic(),
                                 finished_time=time.monotonic(),
                                 num_prompt_tokens=len(state.prompt_token_ids),
                                 num_output_tokens=sum(len(h.token_ids) for h in
                                                       group.hypotheses[:p.n]))
        return RequestOutput(request_id, state.prompt, state.prompt_token_ids, completions, True,
                             metrics)
