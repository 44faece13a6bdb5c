"""Calibration activations: what each attention layer sees (the normalised hidden states) on a
few windows of real text. Used by the `align` conversion."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from kvslim.models.causal_lm import CausalLM
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.train.data import eval_windows, tokenize_file


@torch.no_grad()
def attention_inputs(model: CausalLM, tokenizer: Tokenizer, calib: str | Path,
                     num_samples: int, seq_len: int, show_progress: bool = True,
                     batch_size: int = 4) -> list[torch.Tensor]:
    """Per layer, a [num_samples * seq_len, hidden] float32 matrix of attention inputs."""
    tokens = tokenize_file(calib, tokenizer, show_progress)
    windows = eval_windows(tokens, seq_len, num_samples)[:, :seq_len]
    captured: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def grab(module, args, i=i):
            captured[i].append(args[0].detach().float().reshape(-1, args[0].shape[-1]))
        hooks.append(layer.self_attn.register_forward_pre_hook(grab))
    try:
        for start in tqdm(range(0, len(windows), batch_size), desc="calibrating", unit="batch",
                          disable=not show_progress):
            model(windows[start:start + batch_size].to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(chunks) for chunks in captured]
