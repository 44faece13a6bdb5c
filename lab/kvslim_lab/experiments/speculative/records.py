"""What the speculative study is told and what it records (results.json's schema): the targets
and their proposers, the study's settings, and one `Run` per timed `generate` call."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Target:
    name: str
    model: str
    proposers: dict[str, dict]         # label -> speculative config (without adaptivity)
    chat: bool = False                 # prompts through the chat template


@dataclass
class SpecExperimentConfig:
    targets: list[Target]
    test_text: str                     # passages for the input-grounded workload
    work_dir: str = "runs/speculative"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_tokens: int = 64
    # A batch smaller than this decodes this many prompts, a batch at a time: one prompt's
    # answer (a chat answer may end after 8 tokens) is too few tokens to time or to judge.
    min_prompts: int = 4
    passage_tokens: int = 120
    repeats: int = 2
    # The adaptive arm: the measured thresholds, then these settings over them.
    adaptive: dict = field(default_factory=dict)
    seed: int = 0


@dataclass
class Run:
    target: str
    proposer: str                      # "plain" for the baseline
    workload: str                      # "free" or "grounded"
    batch: int
    arm: str                           # "plain", "spec" or "adaptive"
    repeat: int
    phase: int                         # 1: plain and spec; 2: plain and adaptive
    seconds: float
    output_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0
    steps: int = 0                     # engine steps (target forward passes)
    identical: bool = True             # greedy tokens equal to plain decoding's
    # per draft depth: verifications that drafted that deep, and those accepted to that depth
    drafted_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds
