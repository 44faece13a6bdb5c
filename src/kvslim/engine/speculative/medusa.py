"""`MedusaProposer`: drafts from Medusa heads (drafters/medusa.py) on the hidden state whose
logits drew each sequence's latest token — head k's top token is the guess k + 1 places after
that token; its next best guesses are the tree's other candidates at that depth (tree.py).
Verified by the target's ordinary rules: greedy output is plain decoding's and sampling stays
exact."""
from __future__ import annotations

import torch

from kvslim.drafters.medusa import MedusaHeads
from kvslim.engine.hidden_window import HiddenWindows
from kvslim.engine.sequence import Sequence


class MedusaProposer:
    def __init__(self, heads_dir: str, model):
        heads = MedusaHeads.load(heads_dir)
        c = model.config
        heads.check_fits(c.hidden_size, c.vocab_size, "the model")
        param = next(model.parameters())
        self.heads = heads.to(device=param.device).eval()
        self.lm_head = model.lm_head
        self.windows = HiddenWindows(1)         # the runner fills it after each step

    def runner_feeds(self) -> dict:
        """What the runner keeps for it (RunnerFeatures' fields)."""
        return {"hidden_windows": self.windows}

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], room: list[int], width: int = 1
                ) -> dict[int, list[list[int]]]:
        """seq_id -> per depth up to `room`, the heads' `width` best guesses, best first, for
        the sequences whose hidden state is kept (one that was just admitted or preempted has
        none until its next step)."""
        ready = [(seq, k) for seq, k in zip(seqs, room)
                 if k > 0 and seq.seq_id in self.windows]
        if not ready:
            return {}
        hidden = torch.stack([self.windows.get(seq.seq_id).rows[-1] for seq, _ in ready])
        feats = self.heads.features(hidden.float()).to(hidden.dtype)     # [heads, B, hidden]
        if self.heads.lm_heads is None:
            logits = self.lm_head(feats.flatten(0, 1)).view(*feats.shape[:2], -1)
        else:
            logits = torch.stack([h(f.float()) for h, f in zip(self.heads.lm_heads, feats)])
        guesses = logits.topk(width, dim=-1).indices.transpose(0, 1).tolist()  # [B, heads, w]
        return {seq.seq_id: row[:k] for (seq, k), row in zip(ready, guesses)}

    def release(self, seq_ids: list[int]) -> None:
        """Nothing of its own: the hidden states are the runner's to forget."""
