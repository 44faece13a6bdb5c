"""`DraftTree`: the static shape of the candidates a learned drafter proposes in one step
(Medusa's "medusa_choices"). A node is a path of ranks: (0,) the drafter's best guess for the
next token, (1,) its second best, (0, 2) its third best for the token after, below (0,). The
engine feeds every node's token in one pass, each attending to its own ancestors only
(attention/tree.py), and keeps the longest path the target agrees with.

Medusa heads guess each depth on their own, so any tree fits them; an EAGLE head guesses each
depth from the chain of its best guesses, so only nodes below that chain have guesses: every
rank but a node's last is 0 (`follows_best_chain`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvslim.attention.tree import MAX_TREE_ROWS
from kvslim.errors import KvslimError

MAX_TREE_NODES = MAX_TREE_ROWS - 1      # plus the root, the sequence's last token


@dataclass(frozen=True)
class DraftTree:
    paths: tuple[tuple[int, ...], ...]          # by depth, then by ranks
    parents: tuple[int, ...] = field(init=False)  # per node: its parent node, -1 the root

    def __post_init__(self) -> None:
        paths = self.paths
        where = {path: i for i, path in enumerate(paths)}
        if not paths or len(paths) > MAX_TREE_NODES:
            raise KvslimError(f"a draft tree has 1 to {MAX_TREE_NODES} nodes, got {len(paths)}")
        if len(where) != len(paths):
            raise KvslimError("a draft tree lists each node once")
        for path in paths:
            if not path or any(not isinstance(r, int) or r < 0 for r in path):
                raise KvslimError(f"a draft tree node is a non-empty list of ranks >= 0, "
                                  f"got {list(path)}")
            if len(path) > 1 and path[:-1] not in where:
                raise KvslimError(f"draft tree node {list(path)} has no parent "
                                  f"{list(path[:-1])} in the tree")
        if list(paths) != sorted(paths, key=lambda p: (len(p), p)):
            raise KvslimError("a draft tree lists its nodes by depth, then by ranks")
        object.__setattr__(self, "parents",
                           tuple(where[p[:-1]] if len(p) > 1 else -1 for p in paths))

    @classmethod
    def from_value(cls, value) -> "DraftTree":
        """From a list of paths (JSON's lists of lists), in any order."""
        try:
            paths = [tuple(p) for p in value]
        except TypeError:
            raise KvslimError("a draft tree is a list of paths, each a list of ranks, e.g. "
                              "[[0], [1], [0, 0]]") from None
        return cls(tuple(sorted(paths, key=lambda p: (len(p), p))))

    @classmethod
    def chain(cls, depth: int) -> "DraftTree":
        return cls(tuple((0,) * d for d in range(1, depth + 1)))

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    @property
    def width(self) -> int:
        """Guesses needed per depth: the largest rank + 1."""
        return 1 + max(r for path in self.paths for r in path)

    @property
    def is_chain(self) -> bool:
        return self.width == 1

    @property
    def follows_best_chain(self) -> bool:
        return all(r == 0 for path in self.paths for r in path[:-1])

    def drafts(self, guesses: list[list[int]]) -> tuple[list[int], list[int]]:
        """The nodes' tokens and parents from `guesses[depth - 1][rank]`, cut below the depth
        the guesses reach (a sequence near its max_tokens gets fewer)."""
        n = sum(len(p) <= len(guesses) for p in self.paths)
        return [guesses[len(p) - 1][p[-1]] for p in self.paths[:n]], list(self.parents[:n])
