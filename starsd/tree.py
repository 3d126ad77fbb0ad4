"""Token trees: their shape, the attention they need, and where their accepted path goes.

A token tree of N nodes: node i holds a draft token and its parent's index ``parents[i]`` (-1: a
child of the root, the last committed token); parents come before their children, and the
children of a node are listed in the order they were drawn. Rows indexed by node + 1 (row 0 the
root's) hold what follows each node's path: the target's p, the draft's q. A chain of gamma
tokens is the tree ``parents = [-1, 0, 1, ...]``.

On the target a row's feed is ``prefix`` tokens (its uncached committed tokens, the last one the
root) followed by the N nodes. The prefix is causal; node i sits at the position after its
parent (the root's position + its depth) and sees the whole prefix and its own ancestors only
(:func:`feed_mask`). After verification the accepted path's keys are moved down to follow the
prefix (:func:`kept_columns`): a path node's position is its depth, so after the move every key
sits at the position its RoPE angle was computed for. Siblings hold distinct tokens
(:func:`sibling_problem`), so the committed tokens name the accepted path (:func:`accepted_path`).
A tree cropped to the depth a sequence has room for (:func:`crop_depth`) is again a tree. Pure: no
model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tree_problem(parents: Sequence[int], max_nodes: int) -> str | None:
    """Why ``parents`` is not a token tree of at most ``max_nodes`` nodes (None if it is): a
    parent index out of range, or not before its child (which rules out cycles)."""
    if len(parents) > max_nodes:
        return f"{len(parents)} tree nodes exceed the limit of {max_nodes}"
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            return f"node {i} names parent {parent}: parents must come before their children"
    return None


def sibling_problem(tokens: Sequence[int], parents: Sequence[int]) -> str | None:
    """Why the tree's siblings do not hold distinct tokens (None if they do). Siblings are drawn
    from one law without replacement: a repeated token cannot be such a draw (recursive
    rejection sampling would try it twice against one residual, biasing the result), and the
    accepted path could no longer be named by its tokens."""
    first: dict[tuple[int, int], int] = {}
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        sibling = first.setdefault((parent, token), node)
        if sibling != node:
            return f"tree node {node} repeats token {token} of its sibling {sibling}"
    return None


def is_chain(parents: Sequence[int]) -> bool:
    """Whether the tree is a chain (each node the child of the one before)."""
    return all(parent == i - 1 for i, parent in enumerate(parents))


def chain(length: int) -> tuple[int, ...]:
    """The parents of a chain of ``length`` nodes."""
    return tuple(range(-1, length - 1))


def children(parents: Sequence[int]) -> list[list[int]]:
    """Children of each row (row 0 the root, row i + 1 node i), in drawing order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        out[parent + 1].append(node)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from a child of the root down to ``node`` (-1: the empty path)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (1: a child of the root)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def accepted_path(
    tokens: Sequence[int], parents: Sequence[int], committed: Sequence[int]
) -> list[int]:
    """The nodes of the root path whose tokens are ``committed`` (the draft tokens a
    verification accepted, in order), root side first; unique because siblings are distinct
    (:func:`sibling_problem`). ValueError when no such path exists."""
    kids, row, path = children(parents), 0, []
    for token in committed:
        node = next((c for c in kids[row] if tokens[c] == token), None)
        if node is None:
            raise ValueError(f"token {token} is not a child of row {row} of the tree")
        path.append(node)
        row = node + 1
    return path


def crop_depth(parents: Sequence[int], depth: int) -> tuple[list[int], list[int]]:
    """The tree cut to nodes of depth <= ``depth``: (the kept nodes in order, their parents
    renumbered among the kept). A kept node's parent is shallower, so it is kept too; order is
    kept, so parents still come before children and siblings keep their drawing order."""
    kept = [node for node, d in enumerate(depths(parents)) if d <= depth]
    index = {node: new for new, node in enumerate(kept)}
    return kept, [-1 if parents[node] < 0 else index[parents[node]] for node in kept]


def feed_positions(prefix: int, parents: Sequence[int]) -> list[int]:
    """Offsets of a row's fed columns from its first fed position: the prefix's 0..prefix-1,
    then each node at the root's offset plus its depth."""
    return [*range(prefix), *(prefix - 1 + d for d in depths(parents))]


def feed_mask(prefix: int, parents: Sequence[int]) -> torch.Tensor:
    """[F, F] bool over a row's fed columns (F = prefix + N): True where the column's query may
    see the other's key: causal over the prefix, and a node sees the prefix, its ancestors and
    itself."""
    n, size = len(parents), prefix + len(parents)
    mask = torch.ones(size, size, dtype=torch.bool).tril()
    mask[prefix:, prefix:] = False
    for node, parent in enumerate(parents):
        row = prefix + node
        if parent >= 0:
            mask[row, prefix : prefix + n] = mask[prefix + parent, prefix : prefix + n]
        mask[row, row] = True
    return mask


def kept_columns(prefix: int, path: Sequence[int]) -> list[int]:
    """The fed columns whose keys stay after verification, in order: the prefix, then the
    accepted path's nodes (each moved down to follow the one before)."""
    return [*range(prefix), *(prefix + node for node in path)]


class TreeFeed:
    """A row's fed token tree: ``prefix`` causal tokens (the root last), then nodes with these
    ``parents``; what a verifier backend needs to lay the row out (:func:`feed_mask`,
    :func:`feed_positions`)."""

    __slots__ = ("parents", "prefix")

    def __init__(self, prefix: int, parents: Sequence[int]) -> None:
        if prefix < 1:
            raise ValueError("a tree needs its root fed: prefix >= 1")
        self.prefix, self.parents = prefix, tuple(parents)

    def mask(self) -> torch.Tensor:
        """:func:`feed_mask` of this row."""
        return feed_mask(self.prefix, self.parents)

    def offsets(self) -> list[int]:
        """:func:`feed_positions` of this row."""
        return feed_positions(self.prefix, self.parents)
