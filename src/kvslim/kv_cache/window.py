"""Attention sinks + a sliding window for any model, chosen at serve time (`kv_window`,
`kv_sink_tokens`): token i attends to token j iff j <= i and (j < sinks or i - j < window), at
the tokens' original positions (RoPE is not re-applied: a kept key keeps the rotation it was
written with). StreamingLLM (arXiv 2309.17453) showed why the first tokens stay: attention
parks its excess weight on them, and a window without them collapses.

A layer's own window (a model trained with sliding-window layers) combines with the engine's: the
narrower one wins, and the sinks come with the engine's window only where it is the one that
binds (a layer trained to look back 512 tokens never saw sinks beyond them). Per layer this
gives a `LayerSpan`; layers with equal spans share a KV-cache group (groups.py), whose blocks
outside every live window are released, so a sequence of any length holds the blocks of
sinks + window tokens.

Past the model's trained context: RoPE computes any position (kvslim rotates from positions on
the fly), so with a window a sequence may run longer than max_position_embeddings, for the
static frequency scalings (default, linear, llama3, yarn) only: LongRoPE's long factors were
fitted for contexts up to max_position_embeddings."""
from __future__ import annotations

from dataclasses import dataclass

from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig

@dataclass(frozen=True)
class LayerSpan:
    """What one layer's query sees: the last `window` positions (None: all) plus the first
    `sinks` positions."""
    window: int | None = None
    sinks: int = 0


@dataclass(frozen=True)
class KVWindow:
    """The engine's window and attention sinks (`kv_window`, `kv_sink_tokens`)."""
    window: int
    sinks: int = 0

    @classmethod
    def of(cls, window: int | None, sinks: int | None) -> "KVWindow | None":
        """The options' window, or None when none is set; a one-line error for bad values."""
        if window is None:
            if sinks:
                raise KvslimError("kv_sink_tokens needs kv_window (the sinks are kept beside a "
                                  "sliding window)")
            return None
        if window < 1:
            raise KvslimError(f"kv_window must be a positive number of tokens, got {window}")
        if sinks is not None and sinks < 0:
            raise KvslimError(f"kv_sink_tokens must be >= 0, got {sinks}")
        return cls(window, sinks or 0)

    def span_over(self, model_window: int | None) -> LayerSpan:
        """A layer's span given its own window (None: global): the narrower wins (an equal one
        takes the sinks, so that one window has one sink count: attention/metadata.py)."""
        if model_window is not None and model_window < self.window:
            return LayerSpan(model_window, 0)
        return LayerSpan(self.window, self.sinks)


def layer_spans(config: ModelConfig, kv_window: KVWindow | None,
                layer_plan=None) -> tuple[LayerSpan, ...]:
    """Every layer's span: its own window, narrowed by the engine's when one is set, or by its
    window in a per-layer KV plan (layer_plan.py's KVLayerPlan)."""
    windows = config.layer_sliding_windows
    if layer_plan is not None:
        return tuple(layer_plan.span_over(i, w) for i, w in enumerate(windows))
    if kv_window is None:
        return tuple(LayerSpan(w, 0) for w in windows)
    return tuple(kv_window.span_over(w) for w in windows)


def sink_blocks(sinks: int, block_size: int) -> int:
    """Blocks holding the first `sinks` positions (kept for as long as the sequence runs)."""
    return -(-sinks // block_size)
