"""Prompt logprobs: how likely the model finds each prompt token given the ones before it — what
loglikelihood evaluations (lm-eval-harness through `echo` + `logprobs`) ask of a server. Scored
during prefill from the logits of every prompt position, a slice at a time, so that a long
prompt never materialises a [tokens, vocab] matrix at once."""
from __future__ import annotations

import torch

from kvslim.engine.sequence import Sequence, TokenLogprob

ROWS_PER_SLICE = 256


def record_prompt_logprobs(model, hidden: torch.Tensor, first_row: int, positions: range,
                           seq: Sequence) -> None:
    """Extend `seq.prompt_logprobs` with the scores of the logits at `positions` (each scores
    the prompt token after it); their hidden states are rows first_row.. of `hidden`."""
    if positions.start != len(seq.prompt_logprobs) - 1:
        raise RuntimeError(f"prompt logprobs of request {seq.request_id!r}: position "
                           f"{positions.start} scored out of order")
    k = seq.params.prompt_logprobs or 0
    for lo in range(positions.start, positions.stop, ROWS_PER_SLICE):
        hi = min(lo + ROWS_PER_SLICE, positions.stop)
        rows = hidden[first_row + lo - positions.start:first_row + hi - positions.start]
        logprobs = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
        targets = seq.token_ids[lo + 1:hi + 1]
        index = torch.tensor(targets, device=logprobs.device)[:, None]
        chosen = logprobs.gather(1, index)[:, 0].tolist()
        tops = [[] for _ in targets]
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        seq.prompt_logprobs.extend(TokenLogprob(t, lp, top)
                                   for t, lp, top in zip(targets, chosen, tops))
