"""`LoRARequest`: which adapter a request runs with, under vLLM's names
(`generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))`)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvslim.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int                 # >= 1: the adapter's id in the engine (0 is the base)
    lora_path: str                   # a peft adapter directory

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an integer >= 1, got "
                                      f"{self.lora_int_id!r}", "lora_request")
        if not self.lora_name or not self.lora_path:
            raise InvalidRequestError("a LoRARequest needs a lora_name and a lora_path",
                                      "lora_request")

    @property
    def cache_root(self) -> bytes:
        """The root of its sequences' prefix-cache keys: K/V computed under one adapter are
        never another's (or the base model's)."""
        text = f"kvslim: LoRA {self.lora_int_id} {self.lora_name} {self.lora_path}"
        return hashlib.sha256(text.encode()).digest()
