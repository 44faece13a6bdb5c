"""The KV budget compiler's arithmetic: what each layer's KV setting (a storage precision, and
optionally sinks + a window) costs one sequence in bytes, and the exact choice of one setting
per layer that loses least within a byte budget.

`compile_plan` solves the multiple-choice knapsack exactly: layer by layer it keeps, for every
reachable byte total, the least summed loss, and drops every state another beats in both bytes
and loss (a Pareto front). The front never holds more states than there are distinct byte
totals, so it stays small for the few settings a layer has; brute force agrees on small
instances (tests/kv_cache/test_budget.py)."""
from __future__ import annotations

from dataclasses import dataclass

from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig


# The windows a plan chooses among unless told otherwise, as fractions of the context served.
DEFAULT_WINDOW_FRACTIONS = (1 / 16, 1 / 4, 1 / 2, 3 / 4)


def default_windows(context: int) -> tuple[int, ...]:
    return tuple(w for w in dict.fromkeys(int(context * f) for f in DEFAULT_WINDOW_FRACTIONS)
                 if w >= 1)


@dataclass(frozen=True)
class KVSetting:
    precision: str                      # a kv_cache_dtype: "auto" (the model's), int8, int4, ...
    window: int | None = None           # None: every token; else the last `window` (and sinks)

    @property
    def name(self) -> str:
        return self.precision + ("" if self.window is None else f"+w{self.window}")


def layer_bytes_per_token(config: ModelConfig, layer: int, precision, block_size: int) -> float:
    """One layer's share of what the engine's cache stores per token in `precision` (a torch
    dtype, "auto" resolved; a packed cache's block over its tokens): its KV heads' share of the
    model's bytes (ModelConfig.kv_cache_bytes_per_token, the formula written once)."""
    share = config.kv_heads_of(layer) / sum(config.kv_heads_per_layer)
    return config.kv_cache_block_bytes(precision, block_size) * share / block_size


def sequence_bytes(config: ModelConfig, layer: int, setting: KVSetting, precision, context: int,
                   sinks: int, block_size: int) -> int:
    """The bytes one sequence of `context` tokens holds in this layer (a window releases the
    blocks behind it: sinks + window tokens at most, in whole blocks)."""
    tokens = context if setting.window is None else min(context, sinks + setting.window)
    blocks = -(-tokens // block_size)
    return round(blocks * block_size * layer_bytes_per_token(config, layer, precision,
                                                             block_size))


def compile_plan(options: list[dict[KVSetting, tuple[int, float]]], budget: int
                 ) -> tuple[list[KVSetting], int, float]:
    """One setting per layer from `options` (layer -> setting -> (bytes, loss)) whose summed
    bytes fit `budget` with the least summed loss; returns (settings, bytes, loss). Among
    equal losses the fewer bytes win. KvslimError when even the cheapest choice overflows."""
    cheapest = sum(min(b for b, _ in layer.values()) for layer in options)
    if cheapest > budget:
        raise KvslimError(f"the budget of {budget} bytes is below the cheapest plan's "
                          f"{cheapest}: allow narrower settings or give more memory")
    front: list[tuple[int, float, tuple[KVSetting, ...]]] = [(0, 0.0, ())]
    for layer in options:
        states = [(b + cb, loss + closs, chosen + (s,))
                  for b, loss, chosen in front for s, (cb, closs) in layer.items()
                  if b + cb <= budget]
        front = _pareto(states)
    best = min(front, key=lambda st: (st[1], st[0]))
    return list(best[2]), best[0], best[1]


def _pareto(states: list[tuple[int, float, tuple]]) -> list[tuple[int, float, tuple]]:
    """The states no other beats: by bytes ascending, each with a loss below all cheaper."""
    states.sort(key=lambda st: (st[0], st[1]))
    kept, best = [], float("inf")
    for st in states:
        if st[1] < best:
            kept.append(st)
            best = st[1]
    return kept
