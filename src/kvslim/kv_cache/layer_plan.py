"""A per-layer KV plan (`kvslim plan-kv`'s plan.json, `kv_plan=` / `--kv-plan`): each layer's
storage precision and window, the sinks the windows keep, and the context and concurrency the
plan was compiled for, which also split the engine's budget between its precisions' pools
(`plan.py`): each pool gets the share of the bytes that the plan's sequences hold in it.

The file is the plan's one format: `plan-kv` writes it, the engine reads it here."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvslim.dtypes import KV_CACHE_DTYPES
from kvslim.errors import KvslimError
from kvslim.kv_cache.budget import KVSetting
from kvslim.kv_cache.window import LayerSpan


@dataclass(frozen=True)
class KVLayerPlan:
    layers: tuple[KVSetting, ...]       # one per model layer
    sinks: int                          # the first positions every windowed layer keeps
    context: int                        # tokens per sequence the plan was compiled for
    concurrency: int = 1
    block_size: int = 16

    @classmethod
    def load(cls, path: str | Path) -> "KVLayerPlan":
        """The plan in `path` (plan-kv's JSON); a one-line error for a missing or bad file."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            layers = tuple(KVSetting(str(l["precision"]), l.get("window"))
                           for l in data["layers"])
            plan = cls(layers, int(data.get("sinks", 0)), int(data["context"]),
                       int(data.get("concurrency", 1)), int(data.get("block_size", 16)))
        except FileNotFoundError:
            raise KvslimError(f"kv_plan: no such file {path}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise KvslimError(f"kv_plan: {path} is not a plan written by `kvslim plan-kv` "
                              f"({type(e).__name__}: {e})") from None
        plan.check()
        return plan

    def check(self) -> None:
        for i, s in enumerate(self.layers):
            if s.precision not in KV_CACHE_DTYPES:
                raise KvslimError(f"kv_plan: layer {i}'s precision {s.precision!r} is not one "
                                  f"of {', '.join(KV_CACHE_DTYPES)}")
            if s.window is not None and (not isinstance(s.window, int) or s.window < 1):
                raise KvslimError(f"kv_plan: layer {i}'s window must be a positive number of "
                                  f"tokens, got {s.window!r}")
        if self.sinks < 0 or self.context < 1 or self.concurrency < 1 or self.block_size < 1:
            raise KvslimError("kv_plan: sinks must be >= 0, context, concurrency and "
                              "block_size positive")

    def check_model(self, num_layers: int) -> None:
        if len(self.layers) != num_layers:
            raise KvslimError(f"kv_plan has {len(self.layers)} layers, the model "
                              f"{num_layers}: it was compiled for another model")

    @property
    def precisions(self) -> tuple[str, ...]:
        """The distinct precisions, in layer order: one pool each."""
        return tuple(dict.fromkeys(s.precision for s in self.layers))

    def span_over(self, layer: int, model_window: int | None) -> LayerSpan:
        """The layer's span: its plan window (with the sinks) narrowed by its own window (the
        narrower wins, as for the engine-wide kv_window: window.py)."""
        window = self.layers[layer].window
        if window is None or (model_window is not None and model_window < window):
            return LayerSpan(model_window, 0)
        return LayerSpan(window, self.sinks)

    def to_json(self) -> dict:
        return {"layers": [{"precision": s.precision, "window": s.window} for s in self.layers],
                "sinks": self.sinks, "context": self.context, "concurrency": self.concurrency,
                "block_size": self.block_size}
