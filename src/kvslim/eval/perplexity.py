"""Sliding-window perplexity (`kvslim ppl`), computed the way the transformers documentation
describes it: windows of `context` tokens advancing by `stride`; each window scores only the
tokens not scored by the previous one, with the rest as context."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvslim.errors import KvslimError
from kvslim.models.causal_lm import CausalLM


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float                 # mean negative log-likelihood per scored token (nats)
    num_tokens: int            # tokens scored
    context: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


def windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, num_scored) per window; every token after the first is scored exactly once."""
    if context <= 1 or stride <= 0 or stride > context:
        raise KvslimError(f"need context > 1 and 0 < stride <= context, got context={context}, "
                          f"stride={stride}")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        # A window cannot score its own first token (nothing predicts it), as in transformers.
        scored = min(end - prev_end, end - begin - 1)
        if scored > 0:
            out.append((begin, end, scored))
        prev_end = end
        if end == num_tokens:
            break
    return out


@torch.no_grad()
def perplexity(model: CausalLM, tokens, context: int = 512, stride: int = 256,
               max_tokens: int | None = None, batch_size: int = 8,
               show_progress: bool = True, bos_token_id: int | None = None) -> PerplexityResult:
    """bos_token_id: put it before every window (unscored), as the model sees every prompt
    when its tokenizer adds one (Gemma, Llama 2; llama.cpp's perplexity does the same); the
    scored tokens are the same either way."""
    tokens = torch.from_numpy(np.asarray(tokens[:max_tokens] if max_tokens else tokens[:],
                                         dtype=np.int64))
    if tokens.numel() < 2:
        raise KvslimError("need at least 2 tokens to compute perplexity")
    device = next(model.parameters()).device
    plan = windows(tokens.numel(), context, stride)
    nll, count = 0.0, 0
    bar = tqdm(total=len(plan), desc="perplexity", unit="window", disable=not show_progress)
    for i in range(0, len(plan), batch_size):
        group = plan[i:i + batch_size]
        lead = 0 if bos_token_id is None else 1
        width = max(end - begin for begin, end, _ in group) + lead
        ids = torch.zeros(len(group), width, dtype=torch.long)
        targets = torch.full((len(group), width), -100, dtype=torch.long)
        for row, (begin, end, scored) in enumerate(group):
            n = end - begin + lead
            if lead:
                ids[row, 0] = bos_token_id
            ids[row, lead:n] = tokens[begin:end]
            # Position t predicts token t + 1; score the last `scored` tokens of the window.
            targets[row, n - 1 - scored:n - 1] = tokens[end - scored:end]
        logits = model.logits(ids.to(device)).float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.to(device).reshape(-1),
                               ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
        bar.update(len(group))
        bar.set_postfix(ppl=f"{math.exp(nll / max(count, 1)):.3f}")
    bar.close()
    return PerplexityResult(math.exp(nll / count), nll / count, count, context, stride)


def file_perplexity(model_dir: str | Path, data: str | Path, context: int = 512,
                    stride: int = 256, max_tokens: int | None = None, dtype="float32",
                    device="cpu", show_progress: bool = True,
                    linear_activations: str | None = None) -> PerplexityResult:
    """linear_activations: None scores the weights as loaded (quantized layers dequantized per
    call, float32 arithmetic); "float32" or "int8" first choose the kernels as the engine does
    (kernels/activations.py), so the score is of the arithmetic the engine runs."""
    from kvslim.device import resolve_device
    from kvslim.formats.loader import load_model
    from kvslim.tokenizer.tokenizer import Tokenizer
    from kvslim.train.data import tokenize_file
    model = load_model(model_dir, dtype=dtype, device=resolve_device(device))
    if linear_activations is not None:
        from kvslim.kernels.activations import linear_activations as chosen
        with chosen(linear_activations):
            model.prepare_for_inference()
    tokenizer = Tokenizer.from_dir(model_dir)
    tokens = tokenize_file(data, tokenizer, show_progress)
    return perplexity(model, tokens, context, stride, max_tokens, show_progress=show_progress,
                      bos_token_id=tokenizer.prepended_bos_id)
