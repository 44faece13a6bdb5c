"""Llama 3.1's RoPE scaling as a GGUF file carries it: llama.cpp's converter writes no scaling
parameters, only the divisor of every frequency (`rope_freqs`). kvslim runs the `llama3`
scaling from its parameters, so the importer finds parameters that give back exactly those
divisors — the factor is the largest divisor, the band and the original context come from a
small grid of the values released models use — and refuses a file none of them reproduces."""
from __future__ import annotations

import itertools

import torch

from kvslim.layers.rope import rope_inv_freq

ORIGINAL_CONTEXTS = [2 ** k for k in range(4, 21)]
LOW_FREQ_FACTORS = (1.0, 0.5, 2.0, 4.0)     # 1 first: (low, original) pairs can be equivalent
HIGH_FREQ_FACTORS = (1.0, 2.0, 4.0, 8.0, 16.0)


def llama3_scaling_from_divisors(divisors: torch.Tensor, head_dim: int, theta: float
                                 ) -> dict | None:
    """The `llama3` rope_scaling whose frequencies are exactly plain / divisors, or None."""
    plain = rope_inv_freq(head_dim, theta, None)
    if divisors.shape != plain.shape:
        return None
    for low, orig, high in itertools.product(LOW_FREQ_FACTORS, ORIGINAL_CONTEXTS,
                                             HIGH_FREQ_FACTORS):
        if high <= low:
            continue
        scaling = {"rope_type": "llama3", "factor": float(divisors.max()),
                   "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": orig}
        if torch.allclose(plain / rope_inv_freq(head_dim, theta, scaling), divisors,
                          rtol=1e-5, atol=1e-6):
            return scaling
    return None
