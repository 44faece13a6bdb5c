"""`PathTree`: token paths that all start after a sequence's last token, merged into one tree of
drafts (a prefix two paths share is fed once) and listed by depth, as the scheduler cuts trees
(TokenProposals in scheduler.py). Siblings draft distinct tokens, as tree verification wants."""
from __future__ import annotations


class PathTree:
    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._parents: list[int] = []             # -1: the root (the sequence's last token)
        self._child: dict[tuple[int, int], int] = {}

    def add(self, path: list[int] | tuple[int, ...]) -> int:
        """Adds a path; returns its last node (-1 for an empty path: the root)."""
        node = -1
        for token in path:
            key = (node, token)
            if key not in self._child:
                self._child[key] = len(self._tokens)
                self._tokens.append(token)
                self._parents.append(node)
            node = self._child[key]
        return node

    def __len__(self) -> int:
        return len(self._tokens)

    def listed_by_depth(self, max_depth: int | None = None
                        ) -> tuple[list[int], list[int], list[int | None]]:
        """(tokens, parents, order): the nodes down to `max_depth`, shallowest first (nodes of
        a depth in the order they were added), parents as indices into that list; order[node]
        is a node's index there (None: cut below max_depth)."""
        depth: list[int] = []
        for parent in self._parents:            # a parent is always added before its child
            depth.append(1 if parent < 0 else depth[parent] + 1)
        kept = [i for i in range(len(self._tokens)) if max_depth is None or depth[i] <= max_depth]
        kept.sort(key=lambda i: depth[i])       # stable: the order added within a depth
        order: list[int | None] = [None] * len(self._tokens)
        for new, old in enumerate(kept):
            order[old] = new
        tokens = [self._tokens[i] for i in kept]
        parents = [-1 if self._parents[i] < 0 else order[self._parents[i]] for i in kept]
        return tokens, parents, order
