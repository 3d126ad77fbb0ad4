"""Token-tree shapes, pure (no torch): how large a tree is grown (:class:`TreeShape`), the sizes
``--tree auto`` chooses among (:func:`tree_ladder`), and the tree a shape grows into when the
draft's k-th choice at every node weighs a fixed share of its first (:func:`ranked_tree`: what
the model, ``starsd plan`` and the emulated drafter take a tree of that shape to be).

Shared by the hub (its drafting, :mod:`starsd.hub.drafters.tree_draft`, and its policy), the
emulated drafter and the planner.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

ROOT = -1  # the parent index of a child of the root
MAX_TREE_SHAPES = 3  # tree sizes --tree auto compares (each costs trial phases)
# the emulated draft's next choice at a node holds this much of the one before's probability
CHOICE_WEIGHT = 0.25


@dataclass(frozen=True)
class TreeShape:
    """A tree round's size: children per expanded node, depth and node budget."""

    width: int  # children per expanded node, and nodes expanded per depth
    depth: int  # the deepest node's depth (1: the root's children only)
    nodes: int  # the most nodes a proposal holds

    def __post_init__(self) -> None:
        if self.width < 1 or self.depth < 1 or self.nodes < 1:
            raise ValueError(f"a tree needs width, depth and nodes >= 1, got {self}")

    @property
    def fed_columns(self) -> int:
        """Draft columns the growth feeds after the committed ones (expanded nodes)."""
        return self.width * (self.depth - 1)


def tree_ladder(largest: TreeShape) -> tuple[TreeShape, ...]:
    """The tree shapes ``--tree auto`` compares: ``largest`` (the configured one), then each next
    half its nodes one depth shallower (a shallower tree costs the hub fewer expansion forwards
    and the target fewer rows), while it still holds a node more than one depth's width."""
    shapes = [largest]
    while len(shapes) < MAX_TREE_SHAPES:
        last = shapes[-1]
        smaller = TreeShape(last.width, max(last.depth - 1, 2), last.nodes // 2)
        if smaller.nodes <= smaller.width or smaller == last:
            break
        shapes.append(smaller)
    return tuple(shapes)


@functools.lru_cache(maxsize=64)
def ranked_tree(
    shape: TreeShape, choice_weight: float = CHOICE_WEIGHT
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tokens, parents) of the greedy tree grown to ``shape`` by a draft whose choices at every
    node weigh 1, ``choice_weight``, ``choice_weight ** 2``, ... (token k - 1: its k-th choice):
    EAGLE-2's growth and pruning as the hub's drafting does it (``TreeBatch``; a test checks the
    two agree), on these fixed log-probabilities."""
    per_rank, per_depth = (
        math.log(choice_weight),
        -math.log(sum(choice_weight**k for k in range(shape.width))),
    )
    tokens: list[int] = []
    parents: list[int] = []
    ranks: list[int] = []  # per node: the sum of its path's choice ranks
    depths: list[int] = []
    frontier = [ROOT]
    for depth in range(1, shape.depth + 1):
        for parent in frontier:  # the frontier in score order, each node's children in rank
            for k in range(shape.width):
                tokens.append(k)
                parents.append(parent)
                ranks.append(k + (0 if parent == ROOT else ranks[parent]))
                depths.append(depth)
        # a path's log q, from integers, so that paths of permuted ranks tie exactly and the
        # documented tie rule (the earlier node) decides, not the rounding of running sums
        scores = [r * per_rank + d * per_depth for r, d in zip(ranks, depths, strict=True)]
        drawn = [n for n, d in enumerate(depths) if d == depth]
        frontier = sorted(drawn, key=lambda n: (-scores[n], n))[: shape.width]
    return _pruned(tokens, parents, scores, shape.nodes)


def _pruned(
    tokens: list[int], parents: list[int], scores: list[float], nodes: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``nodes`` best by score (ties: the earlier), re-indexed in their drawing order."""
    keep = sorted(sorted(range(len(tokens)), key=lambda n: (-scores[n], n))[:nodes])
    index = {old: new for new, old in enumerate(keep)}
    kept_parents = tuple(ROOT if parents[n] == ROOT else index[parents[n]] for n in keep)
    return tuple(tokens[n] for n in keep), kept_parents
