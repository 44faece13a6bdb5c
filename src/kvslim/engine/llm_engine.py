"""`LLMEngine`: requests in, incremental outputs out. `add_request` / `step` / `abort_request`
are all the server needs; `LLM` (offline API) drives the same loop."""
from __future__ import annotations

import itertools
import logging
import weakref
from typing import TYPE_CHECKING

from kvslim.engine.beam_search import BeamSearch
from kvslim.engine.block_manager import BlockManager
from kvslim.engine.config import EngineConfig
from kvslim.engine.input_processor import InputProcessor
from kvslim.engine.long_rope import LongRopeSwitch
from kvslim.engine.model_runner import ModelRunner, RunnerFeatures, kv_cache_plan_of
from kvslim.engine.output_processor import OutputProcessor, RequestState
from kvslim.engine.outputs import EmbeddingOutput, KVCacheStats, RankKVStats, RequestOutput
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.scheduler import Scheduler
from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.verify import typical_acceptance_of
from kvslim.errors import ConfigError, EngineFailedError, InvalidRequestError, KvslimError
from kvslim.device import resolve_device
from kvslim.formats.loader import load_model
from kvslim.kernels.activations import linear_activations
from kvslim.structured.grammar import GrammarCompiler
from kvslim.structured.manager import StructuredOutputManager
from kvslim.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:       # imported where used: an engine without these features never loads them
    from kvslim.engine.parallel_executor import TensorParallelExecutor
    from kvslim.engine.speculative.decoder import SpecDecodeStats, SpeculativeDecoder

logger = logging.getLogger("kvslim.engine")


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
            with linear_activations(self.config.linear_activations):
                model.prepare_for_inference()
            if self.config.cuda_sparse_24:
                from kvslim.layers.cuda_sparse24 import use_semi_structured_24
                use_semi_structured_24(model)
            return model
        if self.config.cuda_sparse_24:
            raise ConfigError("cuda_sparse_24 runs on one rank, not with tensor parallelism")
        from kvslim.engine.parallel_executor import TensorParallelExecutor
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
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, eos)
        self.structured = StructuredOutputManager(self.grammar_compiler,
                                                  self.model_config.vocab_size)
        fed = self._fed_proposer()
        self.lora = self._lora_manager()
        self.runner = ModelRunner(self.model, self.config, eos, self.kv_plan, RunnerFeatures(
            structured=self.structured, typical_acceptance=typical_acceptance_of(
                self.config.speculative),
            lora=self.lora, **(fed.runner_feeds() if fed is not None else {})))
        # What runs each step: the runner, or the executor that runs it on every rank.
        self.executor = (self.runner if self.parallel is None
                         else self.parallel.attach(self.runner, self.max_model_len, eos))
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching,
            watermark_blocks=max(1, self.runner.num_blocks // 100) if self.runner.num_blocks > 8 else 0,
            group_windows=self.runner.kv_groups.windows, group_sinks=self.runner.kv_groups.sinks,
            float_tail_blocks=self.runner.residual_blocks, offload=self._kv_offload(model_dir),
            pools=tuple((p.first_block, p.num_blocks) for p in self.kv_plan.pools),
            group_pool=tuple(self.runner.group_pool), demote=self.config.kv_pressure == "demote")
        self.spec = self._speculative_decoder(fed)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, eos,
                                   self.config.enable_chunked_prefill,
                                   LongRopeSwitch.of(self.model_config.rope_scaling), self.spec,
                                   self.config.max_loras if self.lora is not None else None)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.config, self.kv_plan)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beams = BeamSearch(self.scheduler, eos)
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_steps = 0
        self.peak_num_running = 0                    # most sequences decoded in one step
        self.peak_used_blocks = 0

    def _fed_proposer(self):
        """Medusa's or EAGLE's heads on the target's hidden states, or lookahead's window on
        its rows' greedy tokens, when speculation asks: the runner keeps what they read."""
        spec = self.config.speculative
        if spec is None:
            return None
        from kvslim.engine.speculative.learned import FED_METHODS, fed_proposer
        if spec.method not in FED_METHODS:
            return None
        if self.parallel is not None:
            raise KvslimError(f"speculative method {spec.method!r} does not run with "
                              "tensor_parallel_size > 1 yet")
        return fed_proposer(spec, self.model)

    def _speculative_decoder(self, fed) -> SpeculativeDecoder | None:
        spec = self.config.speculative
        if spec is None:
            return None
        from kvslim.engine.speculative.decoder import SpeculativeDecoder
        from kvslim.engine.speculative.draft import DraftModelProposer
        draft = None
        if spec.method == "draft":
            from kvslim.formats.registry import resolve_model
            draft = DraftModelProposer(resolve_model(spec.model), self.config,
                                       self.runner.num_blocks, self.max_model_len,
                                       self.model_config.vocab_size, self.eos_token_ids)
        elif spec.method == "self":
            from kvslim.engine.speculative.self_draft import SelfDraftProposer
            draft = SelfDraftProposer(self.model, self.config, spec.kv_window,
                                      spec.kv_sink_tokens, self.runner.num_blocks,
                                      self.max_model_len, self.eos_token_ids)
        # A constrained sequence's grammar masks follow chains of drafts only.
        return SpeculativeDecoder(spec, draft, fed, self.structured.is_constrained)

    # ---- requests ------------------------------------------------------------------------
    def _kv_offload(self, model_dir):
        """The pool's second tier (--kv-offload-dir / --kv-offload-memory), or None."""
        c = self.config
        if not c.offloads:
            return None
        if len(self.runner.kv_groups.groups) != 1 or self.runner.packed_bits:
            raise ConfigError("the KV offload tier runs with one KV-cache group and an unpacked "
                              "cache (not sliding-window layers, not int4/int2 KV)")
        from kvslim.engine.kv_offload import BlockOffload, model_identity
        from kvslim.kv_cache.tier import KVTier
        identity = model_identity(model_dir, self.runner.kv_dtype, c.block_size,
                                  self.runner.dtype)
        tier = KVTier(identity, c.kv_offload_dir, c.kv_offload_max_bytes,
                      c.kv_offload_memory or 0)
        return BlockOffload(self.runner, tier, c.kv_offload_write_through)

    def _lora_manager(self):
        if not self.config.enable_lora:
            return None
        from kvslim.lora.manager import LoRAManager
        c = self.config
        return LoRAManager(self.model, c.max_loras, c.max_lora_rank, c.max_cpu_loras)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, lora_request=None) -> str:
        """`lora_request`: the LoRARequest whose adapter the request runs with (enable_lora),
        read from its directory on first use."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, ids, params = self.input_processor.process(prompt, params)
        grammar = (self.grammar_compiler.compile(params.structured_outputs, params.max_tokens)
                   if params.structured_outputs is not None else None)
        seq = Sequence(request_id=request_id, token_ids=list(ids), params=params,
                       block_size=self.config.block_size,
                       fork_pending=params.num_sequences > 1 and not params.use_beam_search)
        if lora_request is not None:
            self._acquire_lora(lora_request, seq)
        self.requests[request_id] = self.output_processor.new_request(request_id, text, ids,
                                                                      params, seq)
        if grammar is not None:
            so = params.structured_outputs
            self.structured.add_request(request_id, grammar, so.kind in ("json", "json_object"),
                                        so.reasoning)
        if params.use_beam_search:
            self.beams.add(self.requests[request_id])
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(ids)
        return request_id

    def _acquire_lora(self, lora_request, seq: Sequence) -> None:
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters need an engine started with "
                                      "enable_lora=True (kvslim serve --enable-lora)",
                                      "lora_request")
        self.lora.acquire(lora_request)
        seq.lora_id, seq.lora_root = lora_request.lora_int_id, lora_request.cache_root

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed now. False if unknown."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.seqs:
            self.scheduler.finish(seq, "abort")
            self._release(seq)
        self._forget(state)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def embed(self, prompts: list[str | list[int]], pooling: str = "last"
              ) -> list[EmbeddingOutput]:
        """Each prompt's embedding (engine/embedding.py), computed now, in dense passes that
        leave the KV cache alone: call it between steps, from the thread that steps. Every
        prompt is checked before any runs."""
        if self.parallel is not None:
            raise KvslimError("embeddings run on one rank, not with tensor_parallel_size > 1")
        ids = [self.input_processor.embedding_input(p) for p in prompts]
        from kvslim.engine.embedding import embed_token_lists      # not with `import kvslim`
        vectors = embed_token_lists(self.model, ids, pooling, self.config.max_num_batched_tokens)
        return [EmbeddingOutput(v, t) for v, t in zip(vectors, ids)]

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
        finished_beams = [self._beam_output(request_id) for request_id in self.beams.advance()]
        for seq in self.beams.take_dropped():
            self._release(seq)
        failed = [self._fail(self.requests[request_id], error)
                  for request_id, error in self.structured.take_errors().items()
                  if request_id in self.requests]
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
        return [self._output_or_fail(state) for state in touched.values()] + finished_beams \
            + failed

    def _beam_output(self, request_id: str) -> RequestOutput:
        """A beam-search request is done: its best hypotheses out, its live beams freed."""
        state = self.requests.pop(request_id)
        for seq in state.seqs:
            self.scheduler.finish(seq, "stop")
            self._release(seq)
        self.num_generated_tokens += sum(len(h.token_ids)
                                         for h in self.beams.groups[request_id].hypotheses)
        self._release_lora(state)
        return self.beams.output(request_id, self.tokenizer)

    def _forget(self, state: RequestState) -> None:
        """What the engine kept for a request that has ended (its blocks are freed apart)."""
        self.structured.forget_request(state.request_id)
        self.beams.forget(state.request_id)
        self._release_lora(state)

    def _release_lora(self, state: RequestState) -> None:
        lora_id = state.seqs[0].lora_id if state.seqs else 0
        if lora_id:
            self.lora.release(lora_id)

    def _record_speculation(self, out, sampled) -> None:
        if self.spec is None:
            return
        for entry in out.scheduled:
            if entry.draft_token_ids:
                self.spec.record(entry.seq, entry.draft_token_ids, sampled[entry.seq.seq_id],
                                 entry.draft_parents)

    def _advance(self, state: RequestState, seq: Sequence) -> None:
        """Detokenize what the step appended to `seq`; a stop string finishes it."""
        new, stopped = self.output_processor.advance(state, seq)
        if stopped:
            self.scheduler.finish(seq, "stop")
        self.num_generated_tokens += new
        if seq.finish_reason == "stop" and self.structured.closed_for_budget(seq):
            seq.finish_reason = "length"        # its JSON was closed early, not finished
        if seq.is_finished:
            self._release(seq)

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
        self._forget(state)
        return self.output_processor.failed(state, error)

    def _fail_unschedulable(self) -> RequestOutput:
        """The engine is idle yet cannot admit the head of the queue. add_request's checks
        should make this unreachable; if it happens anyway, end that one request with an error
        instead of stopping the engine for everyone."""
        seq = self.scheduler.waiting[0]
        logger.error("request %s cannot be scheduled", seq.request_id)
        return self._fail(self.requests[seq.request_id], (
            f"request {seq.request_id!r} cannot be scheduled: even with the engine idle it needs "
            f"more KV-cache blocks, sequences or batched tokens than the engine has; aborted"))

    def _release(self, seq: Sequence) -> None:
        """Forget a finished sequence's per-sequence state outside the scheduler (a draft
        model's K/V for it too: freed now, not at the next step)."""
        self.runner.sampler.release(seq)
        if self.runner.hidden_windows is not None:
            self.runner.hidden_windows.pop(seq.seq_id)
        if self.spec is not None:
            self.spec.release([seq.seq_id])

    def _output(self, state: RequestState) -> RequestOutput:
        """The request's output; a finished request is forgotten."""
        out = self.output_processor.output(state)
        if out.finished:
            del self.requests[state.request_id]
            self._forget(state)
        return out

    # ---- introspection -------------------------------------------------------------------
    def kv_cache_stats(self) -> KVCacheStats:
        bm, r = self.block_manager, self.runner
        return KVCacheStats(
            num_blocks=bm.num_blocks, block_size=bm.block_size,
            num_used_blocks=bm.num_used_blocks, num_free_blocks=bm.num_free_blocks,
            num_cached_free_blocks=bm.num_cached_free_blocks,
            bytes_per_token=r.kv_plan.bytes_per_token, bytes_per_block=r.bytes_per_block,
            total_bytes=r.kv_plan.total_bytes, max_tokens=r.kv_plan.max_tokens,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_demoted_blocks=bm.demotion.num_demoted if bm.demotion is not None else 0,
            kv_cache_dtype="+".join(str(p.kv_dtype).removeprefix("torch.")
                                    for p in r.kv_plan.pools))

    def rank_kv_stats(self) -> list[RankKVStats]:
        """Each rank's KV cache as its runner allocated it (one entry on one rank)."""
        return self.parallel.rank_kv_stats() if self.parallel else [self.runner.kv_stats(0)]

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (idempotent; a no-op on one rank, whose engine then
        stays usable). Also runs at garbage collection and at interpreter exit."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def kv_offload_stats(self):
        """The KV offload tier's TierStats (running totals); None without a tier."""
        offload = self.block_manager.offload
        return None if offload is None else offload.tier.stats

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Draft and accepted tokens so far; None when the engine does not speculate."""
        return None if self.spec is None else self.spec.stats

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
