"""Medusa heads (Cai et al. 2024, Medusa-1): extra decoding heads on the model's own last hidden
state, no separate draft model. Head k guesses the token k + 2 places ahead of the hidden
state's position (the model's LM head guesses the next one), through a residual block —
`h + SiLU(W h + b)` — and an LM head: the model's own (shared), or one of its own.

On disk a drafter is a directory: `config.json` (FasterDecoding's field names:
`medusa_num_heads`, `medusa_num_layers`, `hidden_size`, `vocab_size`, `base_model_name_or_path`)
and `medusa_lm_head.safetensors` with FasterDecoding's `medusa_lm_head` keys — head i's residual
block j is `{i}.{j}.linear.weight` / `.bias`, its own LM head `{i}.{num_layers}.weight`. A
shared-head drafter writes no LM head (FasterDecoding's loader would want each head's copy of the
model's, 28 MB a head for SmolLM2): `share_lm_head` in config.json says so."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kvslim.errors import KvslimError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa_lm_head.safetensors"


@dataclass
class MedusaConfig:
    medusa_num_heads: int = 3
    medusa_num_layers: int = 1
    hidden_size: int = 0
    vocab_size: int = 0
    share_lm_head: bool = True
    base_model_name_or_path: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.medusa_num_heads <= 8:
            raise KvslimError(f"medusa_num_heads must be 1-8, got {self.medusa_num_heads}")
        if self.medusa_num_layers < 1:
            raise KvslimError(f"medusa_num_layers must be >= 1, got {self.medusa_num_layers}")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        # Zero weight and bias: the block starts as the identity (SiLU(0) = 0), so every head
        # begins as the LM head (FasterDecoding zeroes the weight only).
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        n, h = config.medusa_num_layers, config.hidden_size
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(h) for _ in range(n)])
                                    for _ in range(config.medusa_num_heads))
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(
            nn.Linear(h, config.vocab_size, bias=False) for _ in range(config.medusa_num_heads))

    @property
    def num_heads(self) -> int:
        return self.config.medusa_num_heads

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [heads, ..., hidden]: what each head feeds its LM head."""
        return torch.stack([block(hidden) for block in self.blocks])

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """[..., hidden] -> [heads, ..., vocab] logits; `lm_head` is the model's (used when the
        heads share it)."""
        feats = self.features(hidden)
        if self.lm_heads is None:
            return lm_head(feats)
        return torch.stack([head(f) for head, f in zip(self.lm_heads, feats)])

    def init_own_lm_heads(self, lm_head_weight: torch.Tensor) -> None:
        """Heads with LM heads of their own start from the model's, as FasterDecoding does."""
        if self.lm_heads is not None:
            for head in self.lm_heads:
                head.weight.data.copy_(lm_head_weight.detach().float())

    # ---- files ---------------------------------------------------------------------------
    def save(self, out: str | Path) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        tensors = {}
        for i, blocks in enumerate(self.blocks):
            for j, block in enumerate(blocks):
                tensors[f"{i}.{j}.linear.weight"] = block.linear.weight
                tensors[f"{i}.{j}.linear.bias"] = block.linear.bias
            if self.lm_heads is not None:
                tensors[f"{i}.{self.config.medusa_num_layers}.weight"] = self.lm_heads[i].weight
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, out / WEIGHTS_FILE)

    @classmethod
    def load(cls, path: str | Path) -> "MedusaHeads":
        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise KvslimError(f"{path} is not a Medusa drafter (needs {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE})")
        fields = json.loads((path / CONFIG_FILE).read_text())
        known = MedusaConfig.__dataclass_fields__
        heads = cls(MedusaConfig(**{k: v for k, v in fields.items() if k in known}))
        state = load_file(path / WEIGHTS_FILE)
        expected = {f"{i}.{j}.linear.{p}" for i in range(heads.num_heads)
                    for j in range(heads.config.medusa_num_layers) for p in ("weight", "bias")}
        if heads.lm_heads is not None:
            expected |= {f"{i}.{heads.config.medusa_num_layers}.weight"
                         for i in range(heads.num_heads)}
        if set(state) != expected:
            raise KvslimError(f"{path / WEIGHTS_FILE}: tensors {sorted(set(state) ^ expected)[:4]} "
                              f"missing or unexpected")
        with torch.no_grad():
            for key, tensor in state.items():
                _parameter(heads, key).copy_(tensor)
        return heads

    def check_fits(self, hidden_size: int, vocab_size: int, model: str) -> None:
        """A one-line error before serving when the heads were trained for another model."""
        c = self.config
        if (c.hidden_size, c.vocab_size) != (hidden_size, vocab_size):
            raise KvslimError(f"the Medusa heads were trained for hidden size {c.hidden_size} "
                              f"and vocabulary {c.vocab_size}; {model} has {hidden_size} and "
                              f"{vocab_size}")


def _parameter(heads: MedusaHeads, key: str) -> torch.Tensor:
    i, j, *rest = key.split(".")
    if j == str(heads.config.medusa_num_layers):
        return heads.lm_heads[int(i)].weight
    return getattr(heads.blocks[int(i)][int(j)].linear, rest[1])
