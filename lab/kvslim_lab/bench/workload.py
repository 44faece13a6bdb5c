"""The requests a benchmark sends: the same token ids to every engine."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    seed: int = 0

    def prompts(self, vocab_size: int, avoid: set[int] | None = None) -> list[list[int]]:
        """Random token ids (special tokens excluded), like vLLM's random dataset: no engine
        gains from a tokenizer or from prefix caching."""
        g = torch.Generator().manual_seed(self.seed)
        avoid = avoid or set()
        out = []
        for _ in range(self.num_prompts):
            ids = torch.randint(0, vocab_size, (self.input_len * 2,), generator=g).tolist()
            ids = [t for t in ids if t not in avoid][:self.input_len]
            out.append(ids)
        return out


def special_ids(tokenizer) -> set[int]:
    added = tokenizer.tok.get_added_tokens_decoder()
    return {i for i, t in added.items() if t.special} | set(tokenizer.eos_token_ids)
