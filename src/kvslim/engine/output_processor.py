"""`OutputProcessor`: from the sequences a step advanced to the `RequestOutput`s it returns
(vLLM v1's output processor): each completion's incremental detokenization and stop strings,
then each request's output with what is new since the previous one, and its metrics. It keeps
no engine state: `LLMEngine` holds the requests, finishes a sequence a stop string ended and
frees what a finished sequence held."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvslim.engine.detokenizer import IncrementalDetokenizer
from kvslim.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.sequence import Sequence
from kvslim.tokenizer.tokenizer import Tokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)      # seq index -> tokens emitted

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.num_sequences and all(s.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def new_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, seq: Sequence) -> RequestState:
        state = RequestState(request_id, prompt, prompt_token_ids, params)
        state.seqs.append(seq)
        state.detokenizers[0] = self._detokenizer(prompt_token_ids, params)
        return state

    def _detokenizer(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                      params.include_stop_str_in_output)

    def advance(self, state: RequestState, seq: Sequence) -> tuple[int, bool]:
        """Decode the tokens the step appended to `seq` (several after a speculative step; a new
        sibling of an n > 1 request joins its request first). A stop string ends the sequence
        at the token that completed it: the output is cut there and `stop_reason` set, and the
        engine finishes it. Returns the tokens decoded and whether a stop string ended it."""
        if seq not in state.seqs:
            state.seqs.append(seq)
            state.detokenizers[seq.index] = self._detokenizer(state.prompt_token_ids,
                                                              state.params)
        detok = state.detokenizers[seq.index]
        before = detok.num_added
        stopped = False
        new = seq.output_token_ids[before:]
        for i, token in enumerate(new):
            if detok.stopped_by is not None:
                break
            if i == len(new) - 1 and _ended_by_stop_token(seq):
                detok.skip_token()
                break
            detok.add_tokens([token], detok.num_added + 1 >= seq.params.min_tokens)
            if detok.stopped_by is not None:
                seq.truncate_output(detok.num_added)
                seq.stop_reason = detok.stopped_by
                stopped = True
        return detok.num_added - before, stopped

    def output(self, state: RequestState) -> RequestOutput:
        completions = [self._completion(state, seq)
                       for seq in sorted(state.seqs, key=lambda s: s.index)]
        if state.params.num_sequences > state.params.n:
            completions = _best(completions, state.params.n, state.finished)
        prompt_logprobs = (state.seqs[0].prompt_logprobs
                           if state.params.prompt_logprobs is not None else None)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             state.finished, self._metrics(state), prompt_logprobs)

    @staticmethod
    def failed(state: RequestState, error: str) -> RequestOutput:
        """The final output of a request ended by a fault in its own work: every completion
        aborted, empty, and `error` says why."""
        completions = [CompletionOutput(index=seq.index, text="", token_ids=[],
                                        finish_reason="abort")
                       for seq in sorted(state.seqs, key=lambda s: s.index)]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             True, RequestMetrics(state.seqs[0].arrival_time,
                                                  num_prompt_tokens=len(state.prompt_token_ids)),
                             error=error)

    @staticmethod
    def _completion(state: RequestState, seq: Sequence) -> CompletionOutput:
        """O(new tokens): the whole token and logprob lists are copied only once, at the end."""
        detok = state.detokenizers[seq.index]
        sent = state.sent_tokens.get(seq.index, 0)
        state.sent_tokens[seq.index] = seq.num_output_tokens
        new = seq.num_output_tokens - sent
        wants_logprobs = seq.params.logprobs is not None
        done = seq.is_finished
        return CompletionOutput(
            index=seq.index, text=detok.text,
            token_ids=seq.output_token_ids if done else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if done and wants_logprobs else None,
            cumulative_logprob=seq.cumulative_logprob,
            delta_text=detok.take_delta(done),
            delta_token_ids=seq.token_ids[len(seq.token_ids) - new:] if new else [],
            delta_logprobs=seq.logprobs[len(seq.logprobs) - new:] if wants_logprobs and new
            else None)

    @staticmethod
    def _metrics(state: RequestState) -> RequestMetrics:
        first = state.seqs[0]
        ends = [s.finished_time for s in state.seqs if s.finished_time is not None]
        return RequestMetrics(
            arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            finished_time=max(ends) if state.finished and ends else None,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_output_tokens=sum(s.num_output_tokens for s in state.seqs),
            num_cached_tokens=first.num_cached_tokens,
            num_preemptions=sum(s.num_preemptions for s in state.seqs))


def _best(completions: list[CompletionOutput], n: int, finished: bool) -> list[CompletionOutput]:
    """best_of > n: nothing while the candidates run, then the n of highest cumulative
    logprob, numbered 0..n-1 (OpenAI's best_of)."""
    if not finished:
        return []
    best = sorted(completions, key=lambda c: (-c.cumulative_logprob, c.index))[:n]
    for i, c in enumerate(best):
        c.index = i
    return best


def _ended_by_stop_token(seq: Sequence) -> bool:
    """Whether the sequence's last token is the EOS or stop token that finished it, and so
    stays out of the text (include_stop_str_in_output keeps it)."""
    return (seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
            and not seq.params.include_stop_str_in_output)
