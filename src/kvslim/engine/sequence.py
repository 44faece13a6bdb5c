"""`Sequence`: one completion being generated, the only object passed between the scheduler, the
block manager and the model runner. Plain Python, no tensors."""
from __future__ import annotations

import enum
import hashlib
import itertools
import time
from array import array
from dataclasses import dataclass, field

from kvslim.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]          # (token_id, logprob), best first


def block_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """The prefix-cache key of a full block: sha256 over the parent block's key and the block's
    token ids (as int64). Token ids determine K/V, and so does LongRoPE's choice of factors (a
    sequence's first block chains from LONG_ROPE_ROOT instead of zeros when it takes the long
    ones); anything else that does (adapters, images, a per-tenant salt) must go into this
    digest too."""
    digest = hashlib.sha256(parent or b"\0" * 32)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


LONG_ROPE_ROOT = hashlib.sha256(b"kvslim: LongRoPE long factors").digest()


def root_of(seq: "Sequence") -> bytes | None:
    """What a sequence's first block hash chains from: K/V that LongRoPE's long factors or a
    LoRA adapter computed never serve another sequence's prefix."""
    root = LONG_ROPE_ROOT if seq.long_rope else None
    if seq.lora_root is not None:
        root = hashlib.sha256((root or b"") + seq.lora_root).digest()
    return root


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]                   # prompt followed by the generated tokens
    params: SamplingParams
    block_size: int
    index: int = 0                         # which of the request's n completions
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0           # tokens whose K/V are in the cache
    num_cached_tokens: int = 0             # of those, taken from the prefix cache at admission
    # One block table per KV-cache group (`kv_cache/groups.py`; most models have one group).
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[bytes] = field(default_factory=list)  # chained digests of full blocks
    # Per group: leading blocks already entered in the prefix cache (or released).
    registered_blocks: list[int] = field(default_factory=lambda: [0])
    # Per group: lowest table index the block manager changed since it last handed the changes
    # to a step (`BlockManager.take_changes`; the runner reads them from the step's entries).
    dirty_from: list[int] = field(default_factory=lambda: [0])
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # params.prompt_logprobs: entry i scores prompt token i given the ones before (None for 0).
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    fork_pending: bool = False             # parent of n > 1 completions, not forked yet
    # A sequence whose tokens a search strategy picks (`params.holds_samples`: beam search):
    # this step's candidates (SampleResults), held until the strategy advances the request.
    held_samples: list = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Phi-3's LongRoPE: the sequence is longer than the model's original context, so every one
    # of its positions is rotated by the long factors (layers/rope.py), which changes its K/V:
    # the flag is part of its prefix-cache key, and the scheduler recomputes the sequence when
    # it grows past the original context.
    long_rope: bool = False
    # The LoRA adapter it runs with (0: the base model), and the root of its prefix-cache keys.
    lora_id: int = 0
    lora_root: bytes | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]              # the first token has no context

    # ---- derived -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def block_table(self) -> list[int]:
        """The first group's block table (the only one, for a model without window groups)."""
        return self.block_tables[0]

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    def hash_blocks(self, num_blocks: int) -> None:
        """Extend block_hashes to the first `num_blocks` full blocks (incremental): the prefix
        cache's keys (`block_hash`, chained from `root_of`)."""
        for i in range(len(self.block_hashes), num_blocks):
            parent = self.block_hashes[i - 1] if i else root_of(self)
            self.block_hashes.append(block_hash(parent, self.block_tokens(i)))

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_sample(self, result, now: float) -> None:
        """Append a sampled token (a sampler SampleResult) with its logprobs and timing."""
        self.token_ids.append(result.token_id)
        if result.logprob is not None:
            self.cumulative_logprob += result.logprob.logprob
            if self.params.logprobs is not None:
                self.logprobs.append(result.logprob)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first `num_output_tokens` (a stop string ended the
        text inside tokens that a speculative step had already appended)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop <= 0:
            return
        del self.token_ids[self.num_prompt_tokens + num_output_tokens:]
        if self.params.logprobs is not None:
            for entry in self.logprobs[-drop:]:
                self.cumulative_logprob -= entry.logprob
            del self.logprobs[-drop:]

    def fork(self, index: int) -> "Sequence":
        """A sibling completion sharing this sequence's tokens (its blocks are shared by the
        block manager, copy-on-write)."""
        child = Sequence(request_id=self.request_id, token_ids=list(self.token_ids),
                         params=self.params, block_size=self.block_size, index=index,
                         num_prompt_tokens=self.num_prompt_tokens, status=self.status,
                         num_computed_tokens=self.num_computed_tokens,
                         num_cached_tokens=self.num_cached_tokens,
                         block_hashes=list(self.block_hashes), long_rope=self.long_rope,
                         lora_id=self.lora_id, lora_root=self.lora_root,
                         prompt_logprobs=self.prompt_logprobs,      # complete by now; shared
                         registered_blocks=list(self.registered_blocks),
                         dirty_from=[0] * len(self.block_tables),
                         arrival_time=self.arrival_time,
                         first_scheduled_time=self.first_scheduled_time)
        return child
