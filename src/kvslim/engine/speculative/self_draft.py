"""`SelfDraftProposer`: self-speculation from a slim view of the cache (TriForce, MagicDec):
the target model drafts k tokens attending only to sinks + a window of its context, then
verifies them against the full cache in one step. No draft model, no training; greedy output
is the target's own, sampling keeps its distribution (the drafts' q is known exactly).

The drafting pass reads the weights but only sinks + window of the K/V, so it pays where
reading the cache is what decoding costs: long contexts, many sequences (a model whose cache
outweighs its weights). It is the draft-model proposer (draft.py) with the target's own
weights and a cache of its own whose window groups release what falls out of the window
(kv_cache/groups.py): its mirrors catch up on accepted tokens as a draft model's do, and the
blocks behind the window go once a mirror's position is final (after each rollback)."""
from __future__ import annotations

from dataclasses import replace

from kvslim.engine.config import EngineConfig
from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.draft import DraftModelProposer


class SelfDraftProposer(DraftModelProposer):
    def __init__(self, model, engine_config: EngineConfig, kv_window: int, kv_sink_tokens: int,
                 target_num_blocks: int, max_model_len: int, eos_token_ids=()):
        """model: the target itself (prepared for inference; its weights are shared)."""
        config = replace(engine_config, speculative=None, enforce_eager=True,
                         kv_window=kv_window, kv_sink_tokens=kv_sink_tokens,
                         keep_out_of_window_blocks=False)
        self._setup(model, config, target_num_blocks, max_model_len, eos_token_ids)

    def _sync(self, seq: Sequence) -> Sequence:
        mirror = super()._sync(seq)
        # its position is final now (a rollback never goes below it): what its next query
        # cannot see goes
        self.block_manager.release_out_of_window(mirror)
        return mirror
