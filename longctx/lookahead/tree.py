"""``DraftTree``: the guessed continuations of one request, and the verify layout they imply.

Owns: the tree's shape (token ids, parent indices), its validation, and what follows from the
shape alone: depths, branches, children and the attention bitmask of each verify query.
Never: torch, choosing the tokens (``drafter``), or judging them (``acceptance``).

A tree of ``n`` nodes is verified as ``n + 1`` new query tokens of one sequence::

    tokens  [A] B C D E          A = the root: the request's last committed token (its
    query    0  1 2 3 4               KV is not cached yet; plain decode would feed it alone)
    parents  .  -1 0 -1 2        node i is query i + 1; parent -1 is the root
    depth    0  1  2 1  2        position of query i + 1 = position of A + depth(node i)

          A ── B ── C            mask of query 0 (A) = 0b00001
          └─── D ── E            mask of query 2 (C) = 0b00111  (A, B, C)
                                 mask of query 4 (E) = 0b11001  (A, D, E)

Bit ``j`` of query ``i``'s mask says query ``i`` may see new token ``j``, the convention of
``kernels/reference.py``; every query also sees the whole cached context. Nodes are in
topological order (a parent's index is smaller than its children's) and siblings carry
distinct tokens, so a root-to-node path spells a distinct continuation.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass
from functools import cached_property

ROOT = -1
MAX_NODES = 62  # the root plus 62 nodes fill the 63 queries a tree mask can describe


@dataclass(frozen=True)
class DraftTree:
    token_ids: list[int]
    parents: list[int]  # parents[i] < i; ROOT (-1) for a child of the root

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", list(self.token_ids))
        object.__setattr__(self, "parents", list(self.parents))
        self._validate()

    def _validate(self) -> None:
        tokens, parents = self.token_ids, self.parents
        if len(tokens) != len(parents):
            raise ValueError(f"a draft tree needs one parent per token, got {len(tokens)} "
                             f"tokens and {len(parents)} parents")
        if len(tokens) > MAX_NODES:
            raise ValueError(f"a draft tree holds at most {MAX_NODES} nodes (tree masks cover "
                             f"63 queries, one is the root), got {len(tokens)}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise ValueError(f"draft token ids must be integers >= 0, got {tokens}")
        for node, parent in enumerate(parents):
            if not (isinstance(parent, int) and ROOT <= parent < node):
                raise ValueError(f"node {node} has parent {parent!r}; parents must be -1 (the "
                                 f"root) or an earlier node index")
        seen = set()
        for parent, token in zip(parents, tokens):
            if (parent, token) in seen:
                raise ValueError(f"two children of node {parent} both carry token {token}; "
                                 f"siblings must differ")
            seen.add((parent, token))

    @classmethod
    def chain(cls, token_ids: list[int]) -> DraftTree:
        """A single branch: each token follows the previous one."""
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)))

    @classmethod
    def empty(cls) -> DraftTree:
        return cls([], [])

    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property
    def _children(self) -> dict[int, list[int]]:
        children: dict[int, list[int]] = {ROOT: []}
        for node, parent in enumerate(self.parents):
            children[node] = []
            children[parent].append(node)
        return children

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (``ROOT`` for the root) in index order, the order they are tried."""
        if not ROOT <= node < len(self):
            raise ValueError(f"node must be -1 (the root) or in [0, {len(self)}), got {node}")
        return list(self._children[node])

    def depths(self) -> list[int]:
        """Depth of each node: 1 for a child of the root."""
        return tree_depths(self.parents)[1:]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (empty for ``ROOT``)."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def branches(self) -> list[list[int]]:
        """One root-to-leaf path of node indices per leaf, leaves in index order."""
        return [self.path(node) for node in range(len(self)) if not self._children[node]]

    def ancestor_masks(self) -> list[int]:
        """Tree-mask words for the ``n + 1`` verify queries (root first): bit j of word i says
        query i sees query j. The root sees itself only; node i (query i + 1) sees the root,
        its ancestors and itself. Fits int64 (at most 63 queries)."""
        return tree_ancestor_words(self.parents)


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of the root (the last token, 0) then of each draft node (parent -1 is the root)."""
    depths = [0]
    for p in parents:
        depths.append(depths[p + 1] + 1)
    return depths


def tree_ancestor_words(parents: Sequence[int]) -> list[int]:
    """The kernels' tree mask for ``[root, node 0, ...]``: bit j of word i says token i sees
    new token j (itself and its ancestors)."""
    words = [1]
    for i, p in enumerate(parents):
        words.append(words[p + 1] | (1 << (i + 1)))
    return words
