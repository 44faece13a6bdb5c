"""Fitting an EAGLE head (drafters/eagle.py) on the frozen model's hidden states.

Each step takes whole self-distilled sequences: at position i the head reads the embedding of
x_{i+1} and f_i (with uniform noise, as EAGLE trains, so that it copes with its own guesses fed
back while drafting) and must give f_{i+1}: a smooth-L1 loss on the hidden state (in units of
its root mean square) plus 0.1 x the cross-entropy of the draft vocabulary's logits against the
model's own next-token distribution from f_{i+1} (EAGLE-1's loss). With `unroll` > 1 the head
also trains on its own guesses, as it drafts beyond the first token: pass r reads, in place of
each f_i, pass r-1's guess of it (detached), against the same targets (training-time test, as
HASS and EAGLE-3 do, here over whole sequences)."""
from __future__ import annotations

import math
import random
from collections import Counter

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvslim.drafters.eagle import EagleHead, WindowAttention

CLASSIFICATION_WEIGHT = 0.1


def draft_vocabulary(answers: list[list[int]], size: int, vocab_size: int,
                     always: list[int]) -> torch.Tensor:
    """The `size` token ids the model says most often in its answers (`always` first, e.g. the
    end-of-sequence ids), topped up with the lowest ids not yet in: byte-level BPE numbers its
    merges in the order it learned them, the more frequent first."""
    counts = Counter(t for answer in answers for t in answer)
    chosen = list(dict.fromkeys([t for t in always if t < vocab_size]
                                + [t for t, _ in counts.most_common()]))[:size]
    taken = set(chosen)
    chosen += [t for t in range(vocab_size) if t not in taken][:size - len(chosen)]
    return torch.tensor(chosen, dtype=torch.long)


def fit_eagle(head: EagleHead, lm_rows: torch.Tensor, embed, hidden, ids, cfg,
              show_progress: bool) -> list[dict]:
    """lm_rows [draft vocab, hidden]: the model's LM head restricted to the draft vocabulary;
    embed: the model's token embedding (frozen); hidden/ids: per sequence, the frozen model's
    hidden states [T, hidden] and its tokens [T]."""
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    rms = torch.cat(hidden).pow(2).mean().sqrt().item()
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    order = list(range(len(hidden)))
    log, bar = [], tqdm(range(cfg.steps), desc="eagle head", disable=not show_progress)
    for step in bar:
        batch = _sample(order, ids, cfg.batch_positions, rng)
        feats, tokens, target, valid = _padded(batch, hidden, ids)
        lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        noise = (torch.rand_like(feats) - 0.5) * (2 * cfg.feature_noise * rms)
        with torch.no_grad():
            embeds = embed(tokens).float()
            want = F.softmax(target @ lm_rows.T, dim=-1)
        positions = torch.arange(feats.shape[1]).expand(feats.shape[:2])
        attn = WindowAttention(head.config.window, positions, key_valid=valid)
        inputs, loss = feats + noise, 0.0
        for _ in range(cfg.unroll):
            guess = head(embeds, inputs, positions, attn)
            logits = guess @ lm_rows.T
            regression = F.smooth_l1_loss(guess[valid] / rms, target[valid] / rms)
            classification = -(want[valid] * F.log_softmax(logits[valid], -1)).sum(-1).mean()
            loss = loss + regression + CLASSIFICATION_WEIGHT * classification
            inputs = torch.cat([inputs[:, :1], guess[:, :-1].detach()], dim=1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            top1 = (logits[valid].argmax(-1) == want[valid].argmax(-1)).float().mean().item()
            entry = {"step": step + 1, "loss": round(loss.item(), 4),   # scores: the last pass
                     "regression": round(regression.item(), 4),
                     "classification": round(classification.item(), 4), "top1": round(top1, 3)}
            log.append(entry)
            bar.set_postfix(loss=entry["loss"], top1=entry["top1"])
    return log


def _sample(order: list[int], ids, positions: int, rng: random.Random) -> list[int]:
    """Whole sequences, at random, until about `positions` positions."""
    batch, total = [], 0
    while total < positions:
        i = rng.choice(order)
        batch.append(i)
        total += len(ids[i]) - 1
    return batch


def _padded(batch: list[int], hidden, ids):
    """Inputs (f_i, x_{i+1}) and targets f_{i+1} for i < T - 1, right-padded: feats, tokens,
    target [B, T-1(, hidden)] and valid [B, T-1]."""
    width = max(len(ids[i]) for i in batch) - 1
    h = hidden[batch[0]].shape[-1]
    feats = torch.zeros(len(batch), width, h)
    target = torch.zeros(len(batch), width, h)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    valid = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, i in enumerate(batch):
        n = len(ids[i]) - 1
        feats[row, :n], target[row, :n] = hidden[i][:-1], hidden[i][1:]
        tokens[row, :n], valid[row, :n] = ids[i][1:], True
    return feats, tokens, target, valid
