"""`LLMEngine`: requests in, incremental outputs out. `add_request` / `step` / `abort_request`
are all the server needs; `LLM` (offline API) drives the same loop."""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field, replace

from kvslim.engine.block_manager import BlockManager
from kvslim.engine.config import EngineConfig
from kvslim.engine.detokenizer import IncrementalDetokenizer
from kvslim.engine.model_runner import ModelRunner, kv_cache_plan_of
from kvslim.engine.parallel_executor import TensorParallelExecutor
from kvslim.engine.parallel_worker import RankKVStats, kv_stats
from kvslim.engine.outputs import CompletionOutput, KVCacheStats, RequestMetrics, RequestOutput
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.scheduler import Scheduler
from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.decoder import SpecDecodeStats, SpeculativeDecoder
from kvslim.engine.speculative.draft import DraftModelProposer
from kvslim.errors import EngineFailedError, InvalidRequestError
from kvslim.device import resolve_device
from kvslim.formats.loader import load_model
from kvslim.kv_cache.groups import longest_sequence
from kvslim.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("kvslim.engine")


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
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model_dir, config: EngineConfig | None = None, tokenizer: Tokenizer | None = None):
        self.config = config or EngineConfig()
        self.parallel: TensorParallelExecutor | None = None      # tensor_parallel_size > 1
        self.model = self._load(model_dir)
        try:
            self._build(model_dir, tokenizer)
        except BaseException:
            self.shutdown()
            raise

    def _load(self, model_dir):
        """The model (rank 0's shard, the other ranks started, with tensor parallelism)."""
        if self.config.tensor_parallel_size == 1:
            model = load_model(model_dir, dtype=self.config.dtype,
                               device=resolve_device(self.config.device))
            model.prepare_for_inference()
            return model
        self.parallel = TensorParallelExecutor.start(model_dir, self.config)
        weakref.finalize(self, self.parallel.shutdown)       # at gc and at interpreter exit
        return self.parallel.model

    def _build(self, model_dir, tokenizer: Tokenizer | None) -> None:
        self.model_config = self.model.config
        self.tokenizer = tokenizer or Tokenizer.from_dir(model_dir)
        eos = list(dict.fromkeys(self.tokenizer.eos_token_ids + self.model_config.eos_token_ids))
        self.eos_token_ids = eos
        self.kv_plan = kv_cache_plan_of(self.model, self.config)
        self.max_model_len = self.kv_plan.max_model_len
        self.runner = ModelRunner(self.model, self.config, eos, self.kv_plan)
        # What runs each step: the runner, or the executor that runs it on every rank.
        self.executor = (self.runner if self.parallel is None
                         else self.parallel.attach(self.runner, self.max_model_len, eos))
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching,
            watermark_blocks=max(1, self.runner.num_blocks // 100) if self.runner.num_blocks > 8 else 0,
            group_windows=self.runner.kv_groups.windows)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, eos,
                                   self.config.enable_chunked_prefill)
        self.spec = self._speculative_decoder()
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_steps = 0
        self.peak_num_running = 0                    # most sequences decoded in one step
        self.peak_used_blocks = 0

    def _speculative_decoder(self) -> SpeculativeDecoder | None:
        spec = self.config.speculative
        if spec is None:
            return None
        draft = None
        if spec.method == "draft":
            from kvslim.formats.registry import resolve_model
            draft = DraftModelProposer(resolve_model(spec.model), self.config,
                                       self.runner.num_blocks, self.max_model_len,
                                       self.model_config.vocab_size, self.eos_token_ids)
        return SpeculativeDecoder(spec, draft)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, ids = self._tokenize(prompt)
        params = self._check_lengths(ids, params)
        self._check_schedulable(len(ids), params)
        self._check_token_ids(params)
        state = RequestState(request_id, text, ids, params)
        seq = Sequence(request_id=request_id, token_ids=list(ids), params=params,
                       block_size=self.config.block_size, fork_pending=params.n > 1)
        state.seqs.append(seq)
        state.detokenizers[0] = self._detokenizer(ids, params)
        self.requests[request_id] = state
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(ids)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            ids, text = list(prompt), None
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                      f"(0..{self.model_config.vocab_size - 1})", "prompt")
        return text, ids

    def _check_lengths(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n_prompt} tokens, but max_model_len is {self.max_model_len}",
                "prompt")
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - n_prompt)
        total = n_prompt + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})", "max_tokens")
        capacity = longest_sequence(self.runner.num_blocks, self.block_manager.group_windows,
                                    self.config.block_size, self.config.max_num_batched_tokens,
                                    total)
        if total > capacity:
            raise InvalidRequestError(
                f"request needs {total} tokens of KV cache, but the whole cache holds {capacity} "
                f"(kv_cache_memory={self.config.kv_cache_memory} bytes); raise kv_cache_memory "
                f"or lower max_tokens", "max_tokens")
        return params

    def _check_schedulable(self, n_prompt: int, params: SamplingParams) -> None:
        """Reject what the scheduler could never admit, even with the engine otherwise idle."""
        cfg = self.config
        if params.n > cfg.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} exceeds the engine's max_num_seqs ({cfg.max_num_seqs}): the n "
                f"completions run as that many sequences at once", "n")
        if cfg.enable_chunked_prefill:
            return
        # Without chunking a prompt is computed in one step (a preempted sequence's recompute
        # may still be chunked, see Scheduler._admit).
        budget = cfg.max_num_batched_tokens
        if n_prompt > budget:
            raise InvalidRequestError(
                f"prompt has {n_prompt} tokens, but without chunked prefill a step computes at "
                f"most max_num_batched_tokens={budget}", "prompt")

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for name in ("logit_bias", "stop_token_ids"):
            bad = [t for t in getattr(params, name) if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                          f"(0..{vocab - 1})", name)

    def _detokenizer(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                      params.include_stop_str_in_output)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed now. False if unknown."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.seqs:
            self.scheduler.finish(seq, "abort")
            self._release(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the requests that made progress."""
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        self.executor.release(out.released_seq_ids)
        if self.spec is not None:
            self.spec.release(out.released_seq_ids)
        if out.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                return [self._fail_unschedulable()]
            return []
        self.num_steps += 1
        self.peak_num_running = max(self.peak_num_running, len(out.scheduled))
        self.peak_used_blocks = max(self.peak_used_blocks, self.block_manager.num_used_blocks)
        try:                         # one forward pass for the whole batch: no single culprit
            sampled = self.executor.execute(out, self.spec and self.spec.draft_probs)
            self._record_speculation(out, sampled)
            updated = self.scheduler.postprocess(out, sampled)
        except Exception as e:
            self.shutdown()                  # other ranks may be mid-step: the engine is done
            raise EngineFailedError(f"the model step failed: {type(e).__name__}: {e}") from e
        touched: dict[str, RequestState] = {}
        failed: list[RequestOutput] = []
        for seq in updated:
            state = self.requests.get(seq.request_id)
            if state is None:                               # aborted, or failed in this loop
                continue
            try:
                self._advance(state, seq)
            except Exception as e:
                logger.exception("request %s failed", state.request_id)
                touched.pop(state.request_id, None)
                failed.append(self._fail(state, f"{type(e).__name__}: {e}"))
                continue
            touched[state.request_id] = state
        return [self._output_or_fail(state) for state in touched.values()] + failed

    def _record_speculation(self, out, sampled) -> None:
        if self.spec is None:
            return
        for entry in out.scheduled:
            if entry.draft_token_ids:
                self.spec.record(entry.seq, entry.draft_token_ids, sampled[entry.seq.seq_id])

    def _advance(self, state: RequestState, seq: Sequence) -> None:
        if seq not in state.seqs:                           # a new sibling of an n > 1 request
            state.seqs.append(seq)
            state.detokenizers[seq.index] = self._detokenizer(state.prompt_token_ids,
                                                              state.params)
        self._detokenize(state, seq)

    def _output_or_fail(self, state: RequestState) -> RequestOutput:
        try:
            return self._output(state)
        except Exception as e:
            logger.exception("request %s failed", state.request_id)
            return self._fail(state, f"{type(e).__name__}: {e}")

    def _fail(self, state: RequestState, error: str) -> RequestOutput:
        """End one request with `error` and free its blocks; the batch goes on without it.
        For faults in a request's own work (detokenizing, stop strings, its output)."""
        self.requests.pop(state.request_id, None)
        for seq in state.seqs:
            self.scheduler.finish(seq, "abort")
            self._release(seq)
        completions = [CompletionOutput(index=seq.index, text="", token_ids=[],
                                        finish_reason="abort")
                       for seq in sorted(state.seqs, key=lambda s: s.index)]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             True, RequestMetrics(state.seqs[0].arrival_time,
                                                  num_prompt_tokens=len(state.prompt_token_ids)),
                             error=error)

    def _fail_unschedulable(self) -> RequestOutput:
        """The engine is idle yet cannot admit the head of the queue. add_request's checks
        should make this unreachable; if it happens anyway, end that one request with an error
        instead of stopping the engine for everyone."""
        seq = self.scheduler.waiting[0]
        logger.error("request %s cannot be scheduled", seq.request_id)
        return self._fail(self.requests[seq.request_id], (
            f"request {seq.request_id!r} cannot be scheduled: even with the engine idle it needs "
            f"more KV-cache blocks, sequences or batched tokens than the engine has; aborted"))

    def _detokenize(self, state: RequestState, seq: Sequence) -> None:
        """Decode the tokens the step appended (several after a speculative step); a stop
        string ends the sequence at the token that completed it."""
        detok = state.detokenizers[seq.index]
        before = detok.num_added
        for token in seq.output_token_ids[before:]:
            if detok.stopped_by is not None:
                break
            detok.add_tokens([token], detok.num_added + 1 >= seq.params.min_tokens)
            if detok.stopped_by is not None:
                seq.truncate_output(detok.num_added)
                seq.stop_reason = detok.stopped_by
                self.scheduler.finish(seq, "stop")
        self.num_generated_tokens += detok.num_added - before
        if seq.is_finished:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Forget a finished sequence's per-sequence state outside the scheduler (a draft
        model's K/V for it too: freed now, not at the next step)."""
        self.runner.sampler.release(seq)
        if self.spec is not None:
            self.spec.release([seq.seq_id])

    def _output(self, state: RequestState) -> RequestOutput:
        completions = [self._completion(state, seq)
                       for seq in sorted(state.seqs, key=lambda s: s.index)]
        finished = state.finished
        if finished:
            del self.requests[state.request_id]
        prompt_logprobs = (state.seqs[0].prompt_logprobs
                           if state.params.prompt_logprobs is not None else None)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished, self._metrics(state), prompt_logprobs)

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

    # ---- introspection -------------------------------------------------------------------
    def kv_cache_stats(self) -> KVCacheStats:
        bm, r = self.block_manager, self.runner
        return KVCacheStats(
            num_blocks=bm.num_blocks, block_size=bm.block_size,
            num_used_blocks=bm.num_used_blocks, num_free_blocks=bm.num_free_blocks,
            num_cached_free_blocks=bm.num_cached_free_blocks,
            bytes_per_token=r.bytes_per_block * bm.num_groups // bm.block_size,
            bytes_per_block=r.bytes_per_block, total_bytes=r.bytes_per_block * bm.num_blocks,
            max_tokens=bm.num_blocks * bm.block_size // bm.num_groups,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_dtype=str(r.kv_dtype).removeprefix("torch."))

    def rank_kv_stats(self) -> list[RankKVStats]:
        """Each rank's KV cache as its runner allocated it (one entry on one rank)."""
        return self.parallel.rank_kv_stats() if self.parallel else [kv_stats(0, self.runner)]

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (idempotent; a no-op on one rank, whose engine then
        stays usable). Also runs at garbage collection and at interpreter exit."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Draft and accepted tokens so far; None when the engine does not speculate."""
        return None if self.spec is None else self.spec.stats

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
