"""The proposers the runner feeds from the target's own forward pass: those that draft from its
hidden states (Medusa heads, an EAGLE head) and lookahead decoding, which reads the greedy tokens
of its tree's rows. Which methods they are, and building one with its checks, before serving
starts (the runner is built with what each asks it to keep: `runner_feeds`)."""
from __future__ import annotations

from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.engine.speculative.eagle import EagleProposer
from kvslim.engine.speculative.medusa import MedusaProposer
from kvslim.errors import KvslimError

LEARNED_METHODS = ("medusa", "eagle")
FED_METHODS = LEARNED_METHODS + ("lookahead",)


def fed_proposer(spec: SpeculativeConfig, model):
    """The proposer of a method in FED_METHODS."""
    windows = [w for w in model.config.layer_sliding_windows if w]
    if windows and spec.num_speculative_tokens >= min(windows):
        # a tree row's ancestors are always inside its window (attention/tree.py)
        raise KvslimError(f"num_speculative_tokens {spec.num_speculative_tokens} reaches the "
                          f"model's sliding window of {min(windows)}")
    if spec.method == "lookahead":
        from kvslim.engine.speculative.lookahead import LookaheadProposer
        return LookaheadProposer(spec)
    return learned_proposer(spec, model)


def learned_proposer(spec: SpeculativeConfig, model) -> MedusaProposer | EagleProposer:
    if spec.method == "eagle":
        return EagleProposer(spec.model, model)
    medusa = MedusaProposer(spec.model, model)
    if spec.num_speculative_tokens > medusa.num_heads:
        raise KvslimError(f"num_speculative_tokens {spec.num_speculative_tokens} is more than "
                          f"the {medusa.num_heads} Medusa heads in {spec.model} guess")
    return medusa
