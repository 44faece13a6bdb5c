"""`InputProcessor`: what `LLMEngine.add_request` checks before a request becomes a `Sequence`
(vLLM v1's input processor). The prompt is tokenized and its ids checked against the vocabulary;
`SamplingParams` are checked against this model and engine: the lengths against max_model_len and
the KV cache, what the scheduler could never admit, the token ids the parameters name. Every
refusal is an `InvalidRequestError` naming the offending field, raised before anything is queued,
so that the server answers it as a 400."""
from __future__ import annotations

from dataclasses import replace

from kvslim.engine.config import EngineConfig
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError
from kvslim.kv_cache.plan import KVCachePlan
from kvslim.tokenizer.tokenizer import Tokenizer


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: EngineConfig,
                 kv_plan: KVCachePlan):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self.kv_plan = kv_plan
        self.max_model_len = kv_plan.max_model_len

    def process(self, prompt: str | list[int], params: SamplingParams
                ) -> tuple[str | None, list[int], SamplingParams]:
        """The prompt's text (None for token ids), its ids, and `params` with max_tokens filled
        in (what is left of max_model_len when the request leaves it unset)."""
        text, ids = self._tokenize(prompt)
        params = self._check_lengths(ids, params)
        self._check_schedulable(len(ids), params)
        self._check_token_ids(params)
        return text, ids, params

    def embedding_input(self, prompt: str | list[int], param: str = "input") -> list[int]:
        """An input to embed: its ids, checked as a prompt's are; it may fill max_model_len,
        since nothing is generated after it."""
        ids = self._tokenize(prompt, param)[1]
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(f"{param} has {len(ids)} tokens, but max_model_len is "
                                      f"{self.max_model_len}", param)
        return ids

    def _tokenize(self, prompt: str | list[int], param: str = "prompt"
                  ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise InvalidRequestError(f"{param} must be a string or a list of token ids",
                                      param)
        if not ids:
            raise InvalidRequestError(f"{param} must not be empty", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})", param)
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
        capacity = self.kv_plan.longest_sequence(self.config.max_num_batched_tokens, total)
        if total > capacity:
            raise InvalidRequestError(
                f"request needs {total} tokens of KV cache, but the whole cache holds {capacity} "
                f"(kv_cache_memory={self.config.kv_cache_memory} bytes); raise kv_cache_memory "
                f"or lower max_tokens", "max_tokens")
        return params

    def _check_schedulable(self, n_prompt: int, params: SamplingParams) -> None:
        """Reject what the scheduler could never admit, even with the engine otherwise idle."""
        cfg = self.config
        if params.num_sequences > cfg.max_num_seqs:
            name = "n" if params.num_sequences == params.n else "best_of"
            what = "beam width" if params.use_beam_search else name
            raise InvalidRequestError(
                f"{what}={params.num_sequences} exceeds the engine's max_num_seqs "
                f"({cfg.max_num_seqs}): the {'n ' if name == 'n' else ''}completions run as that "
                f"many sequences at once",
                name)
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
        vocab = self.vocab_size
        for name in ("logit_bias", "stop_token_ids"):
            bad = [t for t in getattr(params, name) if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                          f"(0..{vocab - 1})", name)
