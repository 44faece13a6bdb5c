"""`EagleProposer`: drafts from an EAGLE head (drafters/eagle.py) on the target's own hidden
states. Per sequence it keeps the head's K/V over the last `window` positions; each step it
catches up on the positions the target computed since (their hidden states are the runner's
`HiddenWindows`), then runs the head once per draft token, every sequence batched, feeding each
guess and its guessed hidden state back in. The drafts form a chain (the top-1 path), with each
depth's next best guesses as a tree's other candidates (tree.py), verified by the target's
ordinary rules: greedy output is plain decoding's and sampling stays exact."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.drafters.eagle import BIG, EagleHead, WindowAttention
from kvslim.engine.hidden_window import HiddenWindow, HiddenWindows
from kvslim.engine.sequence import Sequence


@dataclass
class _HeadKV:
    """The head's K/V for positions end - n + 1 .. end of one sequence."""
    end: int
    k: torch.Tensor                 # [n, kv_heads, head_dim]
    v: torch.Tensor


@dataclass
class _Catchup:
    """One sequence's part of a proposal: its kept K/V, and the new rows (positions
    first..first + n - 1) the head has not seen."""
    seq: Sequence
    room: int
    kv: _HeadKV
    first: int
    feats: torch.Tensor             # [n, hidden]
    tokens: list[int]               # the token each of those hidden states drew


class EagleProposer:
    def __init__(self, drafter_dir: str, model):
        head = EagleHead.load(drafter_dir)
        c = model.config
        head.check_fits(c.hidden_size, c.vocab_size, "the model")
        device = next(model.parameters()).device
        self.head = head.to(device).eval()
        self.embed = model.model.embed_tokens
        self.window = head.config.window
        self.windows = HiddenWindows(self.window)       # the runner fills it after each step
        self.draft_ids = self.head.draft_ids
        with torch.inference_mode():                   # the LM head's rows, dequantized once
            eye = torch.eye(c.hidden_size, device=device, dtype=next(model.parameters()).dtype)
            self.lm_rows = model.lm_head(eye).T[self.draft_ids].float().contiguous()
        attn = self.head.layers[0].self_attn
        self.kv_shape = (attn.num_kv_heads, attn.head_dim)
        self.states: dict[int, _HeadKV] = {}

    def runner_feeds(self) -> dict:
        """What the runner keeps for it (RunnerFeatures' fields)."""
        return {"hidden_windows": self.windows}

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], room: list[int], width: int = 1
                ) -> dict[int, list[list[int]]]:
        """seq_id -> per depth up to `room`, the head's `width` best guesses, best first (each
        depth after the chain of best guesses), for the sequences whose hidden states are kept
        (one that was just admitted or preempted has none until its next step)."""
        parts = [self._catchup(seq, k, self.windows.get(seq.seq_id))
                 for seq, k in zip(seqs, room) if k > 0]
        parts = [p for p in parts if p is not None]
        if not parts:
            return {}
        buffers = self._buffers(parts, max(p.room for p in parts))
        feat = self._run_catchup(parts, *buffers)
        drafts = self._draft_chain(parts, feat, width, *buffers)
        return {p.seq.seq_id: row[:p.room] for p, row in zip(parts, drafts)}

    def _catchup(self, seq: Sequence, room: int, window: HiddenWindow | None) -> _Catchup | None:
        if window is None or window.end != seq.num_tokens - 2:
            return None
        kv = self.states.get(seq.seq_id)
        if kv is None or not window.start - 1 <= kv.end <= window.end:
            kv = _HeadKV(window.start - 1, *self._empty_kv(0))      # start over from the window
        # The last position is always run again: its output is the first draft's input.
        first = min(kv.end + 1, window.end)
        keep = kv.k.shape[0] - (kv.end + 1 - first)
        kv = _HeadKV(first - 1, kv.k[:max(keep, 0)], kv.v[:max(keep, 0)])
        feats = window.rows[first - window.start:]
        return _Catchup(seq, room, kv, first, feats, seq.token_ids[first + 1:window.end + 2])

    def _empty_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.lm_rows.device
        return (torch.zeros(n, *self.kv_shape, device=device),
                torch.zeros(n, *self.kv_shape, device=device))

    def _buffers(self, parts: list[_Catchup], k: int):
        """Per row of the batch: slots for its kept K/V, its new rows and its drafts, plus one
        scratch slot where padding rows write; key positions BIG where nothing is."""
        width = max(p.feats.shape[0] for p in parts)
        slots = max(p.kv.k.shape[0] for p in parts) + width + k + 1
        k_buf, v_buf = (t.view(len(parts), slots, *self.kv_shape)
                        for t in self._empty_kv(len(parts) * slots))
        key_pos = torch.full((len(parts), slots), BIG, dtype=torch.long,
                             device=self.lm_rows.device)
        for b, p in enumerate(parts):
            n = p.kv.k.shape[0]
            k_buf[b, :n], v_buf[b, :n] = p.kv.k, p.kv.v
            key_pos[b, :n] = torch.arange(p.kv.end - n + 1, p.kv.end + 1)
        return k_buf, v_buf, key_pos

    def _run_catchup(self, parts, k_buf, v_buf, key_pos) -> torch.Tensor:
        """The head over every sequence's new rows (right-padded); keeps their K/V; returns
        the output at each sequence's last position [B, hidden]."""
        width, device = max(p.feats.shape[0] for p in parts), self.lm_rows.device
        B, scratch = len(parts), k_buf.shape[1] - 1
        feats = torch.zeros(B, width, self.lm_rows.shape[1], device=device)
        tokens = torch.zeros(B, width, dtype=torch.long, device=device)
        q_pos = torch.zeros(B, width, dtype=torch.long, device=device)
        slots = torch.full((B, width), scratch, dtype=torch.long, device=device)
        for b, p in enumerate(parts):
            n, kept = p.feats.shape[0], p.kv.k.shape[0]
            feats[b, :n] = p.feats.float()
            tokens[b, :n] = torch.tensor(p.tokens, device=device)
            q_pos[b] = p.first + torch.arange(width).clamp(max=n - 1)
            slots[b, :n] = torch.arange(kept, kept + n)
            key_pos[b, kept:kept + n] = q_pos[b, :n]
        attn = WindowAttention(self.window, q_pos, slots, k_buf, v_buf, key_pos)
        out = self.head(self.embed(tokens).float(), feats, q_pos, attn)
        last = []
        for b, p in enumerate(parts):
            n = p.kv.k.shape[0] + p.feats.shape[0]
            lo = max(0, n - self.window)
            self.states[p.seq.seq_id] = _HeadKV(p.first + p.feats.shape[0] - 1,
                                                 k_buf[b, lo:n].clone(), v_buf[b, lo:n].clone())
            last.append(out[b, p.feats.shape[0] - 1])
        return torch.stack(last)

    def _draft_chain(self, parts, feat, width, k_buf, v_buf, key_pos) -> list[list[list[int]]]:
        """k depths per sequence, `width` guesses each: the draft vocabulary's best tokens
        from the guessed hidden state, then the best one and that state fed back in."""
        k = max(p.room for p in parts)
        device = feat.device
        pos = torch.tensor([p.first + p.feats.shape[0] for p in parts], device=device)
        slot = torch.tensor([p.kv.k.shape[0] + p.feats.shape[0] for p in parts], device=device)
        rows = torch.arange(len(parts), device=device)
        drafts = []
        for j in range(k):
            ranked = self.draft_ids[(feat @ self.lm_rows.T).topk(width, dim=-1).indices]
            drafts.append(ranked)
            token = ranked[:, 0]
            if j == k - 1:
                break
            key_pos[rows, slot] = pos
            attn = WindowAttention(self.window, pos[:, None], slot[:, None], k_buf, v_buf,
                                   key_pos)
            feat = self.head(self.embed(token[:, None]).float(), feat[:, None], pos[:, None],
                             attn)[:, 0]
            pos, slot = pos + 1, slot + 1
        return torch.stack(drafts, dim=1).tolist()

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.states.pop(seq_id, None)
