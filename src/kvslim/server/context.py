"""`ServerContext`: what every route needs, built once per app (no module globals)."""
from __future__ import annotations

from dataclasses import dataclass

from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.server.async_engine import AsyncEngine
from kvslim.server.errors import model_not_found
from kvslim.server.metrics import ServerMetrics


@dataclass
class ServerContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None

    def check_model(self, name: str | None) -> None:
        """A request may omit `model`; if it names one, it must be the one we serve."""
        if name is not None and name != self.model_name:
            raise model_not_found(name)
