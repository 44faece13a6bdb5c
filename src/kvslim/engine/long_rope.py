"""LongRoPE as the scheduler sees it: a `LengthSwitch`. Phi-3's LongRoPE rotates every position
of a sequence longer than the model's original context by its long factors, as transformers
does; a sequence that grows past that length is computed again the long way (transformers
drops its cache then), and a longer prompt is computed so from the start. The scheduler asks
the switch, never the rope scaling."""
from __future__ import annotations

from typing import Any, Protocol

from kvslim.engine.sequence import Sequence
from kvslim.layers.rope import longrope_original_context


class LengthSwitch(Protocol):
    """A length past which a sequence is a different kind of sequence whose K/V must be
    computed again (the scheduler recomputes it as it would a preempted one)."""

    def outgrew(self, seq: Sequence) -> bool:
        """Whether `seq` has grown past the length and not switched yet."""

    def room(self, seq: Sequence) -> int | None:
        """Tokens `seq` may still compute before the length (None: no limit): the depth a
        step's drafts may reach."""

    def switch(self, seq: Sequence) -> None:
        """Make `seq` the other kind (its cached blocks, computed the old way, stay under their
        own prefix-cache key)."""


class LongRopeSwitch:
    def __init__(self, original_context: int):
        self.original_context = original_context

    @classmethod
    def of(cls, rope_scaling: dict[str, Any] | None) -> "LongRopeSwitch | None":
        length = longrope_original_context(rope_scaling)
        return None if length is None else cls(length)

    def outgrew(self, seq: Sequence) -> bool:
        return not seq.long_rope and seq.num_tokens > self.original_context

    def room(self, seq: Sequence) -> int | None:
        # verify short-rotated positions only: the original context's last one at most
        return None if seq.long_rope else self.original_context - seq.num_tokens

    def switch(self, seq: Sequence) -> None:
        seq.long_rope = True
        seq.block_hashes = []
