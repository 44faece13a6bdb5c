"""`SamplingParams`: how one request is decoded. Validated on creation; every error names the
field (`param`) so that the server can answer with an OpenAI-style 400."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvslim.errors import InvalidRequestError
from kvslim.structured.params import StructuredOutputsParams


GREEDY_BELOW_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
MAX_PENALTY = 2                      # presence and frequency penalties lie in [-2, 2]
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1   # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None: up to the model's max length
    min_tokens: int = 0
    temperature: float = 1.0             # 0 (or below 1e-5) = greedy
    top_k: int = 0                       # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0      # HF/CTRL style, prompt and output tokens
    presence_penalty: float = 0.0        # OpenAI style, output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    ignore_eos: bool = False
    logprobs: int | None = None          # None: none; k >= 0: chosen token + top-k
    prompt_logprobs: int | None = None   # logprob of every prompt token (+ top-k); no prefix cache
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The output must match a JSON schema, a regex, a choice or a grammar (structured/).
    structured_outputs: StructuredOutputsParams | None = None
    # best_of > n: best_of completions, the n with the highest cumulative logprob returned.
    best_of: int | None = None
    # Beam search (engine/beam_search.py) of width best_of (or n), the n best returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0          # score = cumulative logprob / length ** length_penalty
    early_stopping: bool | str = False   # True, False or "never", as in transformers

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param=param)

        check(_is_int(self.n) and self.n >= 1, "n", f"n must be at least 1, got {self.n!r}")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              f"min_tokens must be >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(_is_finite(self.temperature) and self.temperature >= 0, "temperature",
              f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
              f"top_k must be -1, 0 (off) or positive, got {self.top_k!r}")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p",
              f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p",
              f"min_p must be in [0, 1], got {self.min_p!r}")
        # Logits are float32: outside this range the penalty rounds to 0 or inf and the row
        # turns to NaN.
        check(_is_num(self.repetition_penalty)
              and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
              "repetition_penalty", f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
              f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_num(value) and -MAX_PENALTY <= value <= MAX_PENALTY, name,
                  f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
        # torch.Generator.manual_seed takes a signed or unsigned 64-bit integer, nothing wider.
        check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
              "seed",
              f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              "stop must be a non-empty string or a list of non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "stop_token_ids must be non-negative integers")
        check(all(_is_int(t) and t >= 0 and _is_num(b) and -100 <= b <= 100
                  for t, b in self.logit_bias.items()), "logit_bias",
              "logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        check(self.logprobs is None
              or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        check(self.prompt_logprobs is None
              or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
              "prompt_logprobs", f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, "
              f"got {self.prompt_logprobs!r}")
        self._validate_choice_of_answers(check)

    def _validate_choice_of_answers(self, check) -> None:
        """best_of, beam search and structured outputs, and what they do not combine with."""
        check(self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n),
              "best_of", f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        check(_is_finite(self.length_penalty), "length_penalty",
              f"length_penalty must be a finite number, got {self.length_penalty!r}")
        check(self.early_stopping in (True, False, "never"), "early_stopping",
              f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        check(not (self.use_beam_search and self.structured_outputs is not None),
              "use_beam_search", "beam search does not take structured outputs")
        check(not (self.use_beam_search and self.stop), "use_beam_search",
              "beam search does not take stop strings (stop_token_ids end hypotheses)")
        check(not (self.use_beam_search and self.prompt_logprobs is not None),
              "use_beam_search", "beam search does not take prompt_logprobs")
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "structured_outputs must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32 and the draw would be NaN; the
        # distribution is a point mass on the argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def num_sequences(self) -> int:
        """Completions run at once: the beam width, best_of, or n."""
        return self.best_of or self.n

    @property
    def holds_samples(self) -> bool:
        """Its sampled candidates are held for a search strategy to pick from (beam search,
        engine/beam_search.py), not appended by the scheduler."""
        return self.use_beam_search

    @property
    def needs_logprob(self) -> bool:
        """The chosen token's logprob is needed: asked for, or to rank completions."""
        return self.logprobs is not None or self.use_beam_search or \
            (self.best_of or self.n) > self.n

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _is_finite(x) -> bool:
    return _is_num(x) and math.isfinite(x)
