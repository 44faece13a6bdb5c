"""`SpeculativeConfig`: how the engine speculates, with vLLM's option names where they exist
(`method`, `model`, `num_speculative_tokens`, `prompt_lookup_min/max`,
`disable_by_batch_size`), `tree`, the shape of a learned drafter's candidates (tree.py), and
lookahead decoding's `window`, `ngram`, `guesses` (llama.cpp's W, N, G; lookahead.py)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvslim.engine.speculative.tree import MAX_TREE_NODES, DraftTree
from kvslim.errors import KvslimError

METHODS = ("ngram", "draft", "medusa", "eagle", "lookahead", "self")
ACCEPTANCE = ("exact", "typical")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    # k: tokens proposed per sequence and step (3; with a tree, its depth)
    num_speculative_tokens: int | None = None
    model: str | None = None                 # "draft": the draft model; "medusa"/"eagle": the
                                             # drafter's directory (kvslim train-drafter)
    prompt_lookup_min: int = 1               # method "ngram": shortest suffix that may match
    prompt_lookup_max: int = 4               # and the longest, tried first
    # No speculation in a step with more running sequences than this (None: always). The
    # default is measured (`kvslim experiment speculative`, docs/speculative.md): on the CPUs
    # measured every draft model and learned drafter lost from 8 concurrent sequences on, and
    # n-gram won or lost there by model and workload (0.90-1.27x); measure on a GPU.
    disable_by_batch_size: int | None = 1
    # Per sequence: after `backoff_window` drafted tokens with acceptance below
    # `backoff_acceptance` (0: never), the sequence stops proposing for `backoff_steps` steps,
    # doubling after each further such window in a row.
    backoff_acceptance: float = 0.0
    backoff_window: int = 8
    backoff_steps: int = 16
    # Sampled requests: "exact" (rejection sampling, the target's distribution) or "typical"
    # (Medusa's typical acceptance: more drafts kept, not exact; verify.py). Greedy requests are
    # exact either way; a draft model's drafts always take the exact rule.
    acceptance: str = "exact"
    typical_threshold: float = 0.09
    typical_alpha: float = 0.3
    # Methods "medusa" and "eagle": the candidates as a tree of rank paths, e.g. [[0], [1],
    # [0, 0]] (tree.py); None: one chain of num_speculative_tokens.
    tree: list[list[int]] | DraftTree | None = None
    # Method "lookahead" (Fu et al. 2024): each step runs `window` columns of Jacobi guesses,
    # `ngram` - 1 iterations deep, and verifies up to `guesses` n-grams of `ngram` tokens from
    # the sequence's pool (at most `pool_size` of them) that start with its last token.
    # Defaults: the best of the shapes tried on SmolLM2 at batch 1 on 2 CPU cores (a wider
    # window fed more rows than its n-grams won back; docs/speculative.md).
    window: int = 2
    ngram: int = 4
    guesses: int = 3
    pool_size: int = 1024
    # Method "self" (self_draft.py): the target drafts attending to the last `kv_window`
    # tokens and the first `kv_sink_tokens` (the engine's own option names, kv_cache/window.py).
    kv_window: int | None = None
    kv_sink_tokens: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise KvslimError(f"speculative method must be one of {', '.join(METHODS)}, "
                              f"got {self.method!r}")
        if self.method == "lookahead":
            self._resolve_lookahead()
        self._resolve_tree()
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise KvslimError("num_speculative_tokens must be between 1 and "
                              f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.method == "draft" and not self.model:
            raise KvslimError("speculative method 'draft' needs 'model', the draft model")
        if self.method in ("medusa", "eagle") and not self.model:
            raise KvslimError(f"speculative method {self.method!r} needs 'model', the "
                              "drafter's directory (kvslim train-drafter)")
        if self.method == "self":
            self._resolve_self()
        if self.method in ("ngram", "lookahead", "self") and self.model:
            raise KvslimError(f"speculative method {self.method!r} takes no 'model'")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise KvslimError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise KvslimError("disable_by_batch_size must be at least 1, got "
                              f"{self.disable_by_batch_size}")
        if not 0.0 <= self.backoff_acceptance <= 1.0:
            raise KvslimError("backoff_acceptance must be in [0, 1], got "
                              f"{self.backoff_acceptance}")
        if self.acceptance not in ACCEPTANCE:
            raise KvslimError(f"speculative acceptance must be one of {', '.join(ACCEPTANCE)}, "
                              f"got {self.acceptance!r}")
        if not (0 < self.typical_threshold <= 1 and 0 < self.typical_alpha <= 1):
            raise KvslimError("typical_threshold and typical_alpha must be in (0, 1]")
        if self.backoff_window < 1 or self.backoff_steps < 0:
            raise KvslimError("backoff_window must be >= 1 and backoff_steps >= 0")

    def _resolve_tree(self) -> None:
        if self.tree is None:
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = 3
            return
        if self.method not in ("medusa", "eagle"):
            raise KvslimError(f"a draft tree needs a learned drafter (method medusa or eagle), "
                              f"not {self.method!r}")
        if not isinstance(self.tree, DraftTree):
            self.tree = DraftTree.from_value(self.tree)
        if self.method == "eagle" and not self.tree.follows_best_chain:
            raise KvslimError("an EAGLE head guesses each depth after its best guess only: "
                              "every rank of a tree node but its last must be 0")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = self.tree.depth
        elif self.num_speculative_tokens != self.tree.depth:
            raise KvslimError(f"num_speculative_tokens {self.num_speculative_tokens} differs "
                              f"from the draft tree's depth {self.tree.depth} (leave it out)")

    def _resolve_self(self) -> None:
        if self.kv_window is None:
            raise KvslimError("speculative method 'self' needs kv_window: the tokens its drafts "
                              "attend to (plus kv_sink_tokens)")
        if self.kv_window < 1 or self.kv_sink_tokens < 0:
            raise KvslimError(f"speculative method 'self' needs kv_window >= 1 and "
                              f"kv_sink_tokens >= 0, got {self.kv_window} and "
                              f"{self.kv_sink_tokens}")

    def _resolve_lookahead(self) -> None:
        """Bounds of the lookahead tree, and its depth as num_speculative_tokens: the window's
        last column reaches window - 1 + ngram - 2 tokens deep, a pool n-gram ngram - 1."""
        w, n, g = self.window, self.ngram, self.guesses
        if w < 1 or n < 2 or g < 0 or self.pool_size < 1:
            raise KvslimError(f"lookahead needs window >= 1, ngram >= 2, guesses >= 0 and "
                              f"pool_size >= 1, got {w}, {n}, {g}, {self.pool_size}")
        # the suffix match (prompt lookup) joins the pool's `guesses` n-grams
        rows = (w - 1) + w * (n - 2) + (g + 1) * (n - 1)
        if rows > MAX_TREE_NODES:
            raise KvslimError(f"lookahead window {w}, ngram {n}, guesses {g} feed up to {rows} "
                              f"tokens a step, more than the {MAX_TREE_NODES} a tree holds")
        depth = max(w + n - 3, n - 1)
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = depth
        elif self.num_speculative_tokens != depth:
            raise KvslimError(f"num_speculative_tokens {self.num_speculative_tokens} differs "
                              f"from the lookahead tree's depth {depth} (leave it out)")

    @property
    def draft_tree(self) -> DraftTree:
        """The shape of a learned drafter's candidates: the tree, or a chain of k."""
        return self.tree if self.tree is not None else DraftTree.chain(
            self.num_speculative_tokens)

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict[str, Any] | None"
                   ) -> "SpeculativeConfig | None":
        """A config from what a user passed: None, a config, or a dict of its fields."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise KvslimError(f"speculative must be a dict of options, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise KvslimError(f"unknown speculative option(s): {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        return cls(**value)
