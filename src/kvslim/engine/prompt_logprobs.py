"""Prompt logprobs: how likely the model finds each prompt token given the ones before it — what
loglikelihood evaluations (lm-eval-harness through `echo` + `logprobs`) ask of a server. Scored
during prefill from the logits of every prompt position, a slice at a time, so that a long
prompt never materialises a [tokens, vocab] matrix at once."""
from __future__ import annotations

import torch

from kvslim.engine.sequence import Sequence, TokenLogprob

ROWS_PER_SLICE = 256


def record_prompt_logprobs(model, hidden: torch.Tensor, query_start: int, start: int,
                           num_tokens: int, seq: Sequence) -> None:
    """Extend `seq.prompt_logprobs` with what this prefill chunk scores. `hidden` holds the
    step's final hidden states; the chunk's tokens (positions start.. start + num_tokens) are
    rows query_start.. of it. Positions already scored (before a preemption) are skipped."""
    first = len(seq.prompt_logprobs) - 1                 # position whose logits score token first+1
    end = min(start + num_tokens, seq.num_prompt_tokens - 1)
    if first < start:
        raise RuntimeError("prompt logprobs: a prefill chunk skipped unscored positions")
    k = seq.params.prompt_logprobs or 0
    for lo in range(first, end, ROWS_PER_SLICE):
        hi = min(lo + ROWS_PER_SLICE, end)
        rows = hidden[query_start + lo - start:query_start + hi - start]
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
