"""Plain result objects returned by the engine and the offline API."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvslim.engine.sequence import TokenLogprob


@dataclass
class CompletionOutput:
    """One completion's progress. `text` is always the whole text so far; `token_ids` and
    `logprobs` are the complete lists only once finished (None while running), so that a step
    never copies what earlier steps already reported: stream with the `delta_*` fields."""
    index: int
    text: str
    token_ids: list[int] | None
    finish_reason: str | None = None          # "stop", "length", "abort" or None (running)
    stop_reason: str | int | None = None      # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    delta_text: str = ""                      # new text since the previous output (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    # LLM.chat with tools: the calls parsed from `text` (kvslim.tools.spec.ToolCall)
    tool_calls: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0                # prompt tokens served by the prefix cache
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first."""
        if self.finished_time is None or self.first_token_time is None \
                or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With params.prompt_logprobs: one entry per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Set when the engine ended the request itself (its finish_reason is then "abort"); None
    # for requests that ran normally or were aborted by the caller.
    error: str | None = None


@dataclass
class EmbeddingOutput:
    """One input's embedding (engine/embedding.py) and the token ids it was computed from."""
    embedding: list[float]
    prompt_token_ids: list[int]


@dataclass
class KVCacheStats:
    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    bytes_per_token: int                      # all layers' K/V, plus scales when quantized
    bytes_per_block: int                      # one block id: one KV-cache group's layers
    total_bytes: int
    max_tokens: int                           # token slots of one KV-cache group
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_cache_dtype: str = "float32"           # "int8" / "float8_e4m3fn" when quantized
    num_demoted_blocks: int = 0               # --kv-pressure demote: blocks moved to int8

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class RankKVStats:
    """One rank's paged KV cache, as its ModelRunner allocated it."""
    rank: int
    num_blocks: int
    bytes_per_block: int
    kv_slot_bytes: int                 # bytes one token takes in the allocated tensors
    # All layers' bytes per token (a block holds one KV-cache group's layers: kv_slot_bytes
    # times the groups), what the planner's per-rank figure counts.
    kv_bytes_per_token: int = 0
