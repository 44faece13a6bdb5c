"""Each family's weight-name rule at the checkpoint boundary. Inside kvslim every model's
tensors go by the Llama family's HF names (q_proj, k_proj, v_proj, gate_proj, up_proj); a family
whose checkpoints name or stack them otherwise (Phi-3's fused projections) is translated here,
once when a checkpoint is read and once when one is written."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvslim.models import mixtral, phi3
from kvslim.models.config import ModelConfig


def needs_translation(name: str, config: ModelConfig) -> bool:
    if config.model_type == "mixtral":
        return mixtral.is_checkpoint_name(name)
    return config.model_type == "phi3" and phi3._layer_and_module(name) is not None


def from_checkpoint(name: str, tensor: torch.Tensor, config: ModelConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """A stored tensor as the tensors kvslim's names give it (one, or a fused one's parts)."""
    if config.model_type == "phi3":
        yield from phi3.split_tensor(name, tensor, config)
    elif config.model_type == "mixtral":
        yield mixtral.to_kvslim_name(name), tensor
    else:
        yield name, tensor


def to_checkpoint(state: dict[str, torch.Tensor], config: ModelConfig
                  ) -> dict[str, torch.Tensor]:
    """kvslim's names -> the family's checkpoint names (what transformers loads)."""
    if config.model_type == "mixtral":
        return mixtral.to_checkpoint(state)
    return phi3.fuse_state(state, config) if config.model_type == "phi3" else state
