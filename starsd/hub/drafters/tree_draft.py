"""Token-tree drafting, shared by every proposer: grow each session's tree depth by depth.

A tree is grown as EAGLE-2 grows its dynamic trees. The root is the last committed token; its
logits (the chain's first draft position) give ``width`` children. At each next depth the
``width`` nodes of the depth just drawn with the highest cumulative draft log-probability (the
path's) are expanded: they are fed to the draft as the columns of one forward, each attending
to the committed keys, its own ancestors and itself (:meth:`TreeBatch.feed`), and each gets
``width`` children from its logits. Every row of a batch grows in the same forwards.

Which children a node gets, by the sampling rule (:mod:`starsd.sampling`'s tree section):

* greedy: the draft's top ``width`` tokens; at the end only the ``nodes`` best nodes by
  cumulative probability are kept (an ancestor always scores at least its child, so what is
  kept is a tree; greedy verification is exact whatever the tree);
* sampled: ``width`` tokens drawn one after another without replacement from q
  (:func:`starsd.sampling.draw_children`), and nothing is pruned afterwards: recursive rejection
  sampling is exact only when a node's children are such draws, their number fixed before they
  are drawn. Which nodes get children may depend on the nodes themselves (their children are
  drawn after), so the frontier is chosen by score either way; the node budget is checked
  before each node's children are drawn.

Pure torch on logits: a proposer supplies the forwards (:meth:`TreeBatch.feed` says what to
feed, :meth:`TreeBatch.grow` takes the logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from starsd import sampling
from starsd.hub.drafters.vocab import DraftVocab
from starsd.protocol import SamplingParams
from starsd.tree_shapes import ROOT, TreeShape


@dataclass
class GrownTree:
    """One row's tree: nodes in drawing order, and what the draft saw of each."""

    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # target ids
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # the path's cumulative log q
    q_rows: list[torch.Tensor] = field(default_factory=list)  # sampled: the law of each node
    column: dict[int, int] = field(default_factory=dict)  # node -> its fed column
    frontier: list[int] = field(default_factory=lambda: [ROOT])  # expanded at the next forward

    def ancestors(self, node: int) -> list[int]:
        """``node`` and its ancestors (not the root)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out


class TreeBatch:
    """The trees of a batch's rows, grown together (drafting thread only).

    ``committed`` [B, T0] bool says which of the first T0 buffer columns hold each row's real
    committed keys (None: all of them); fed nodes take the columns after, ``shape.width`` per
    forward.
    """

    def __init__(
        self,
        trees: Sequence[GrownTree],
        shape: TreeShape,
        committed_columns: int,
        committed: torch.Tensor | None,
        vocab: DraftVocab | None = None,
    ) -> None:
        self.trees, self.shape, self.vocab = list(trees), shape, vocab
        self.base = committed_columns
        self.committed = committed
        self.forwards = 0  # expansion forwards fed so far

    def grow(self, logits: torch.Tensor, depth: int) -> bool:
        """Draw the children of every row's frontier from ``logits`` [B, w, V] (w frontier
        columns; the root's [B, 1, V] at depth 1), then pick the next frontier. Returns whether
        another forward is needed (some row has a frontier)."""
        for i, tree in enumerate(self.trees):
            for j, parent in enumerate(tree.frontier):
                room = self._room(tree)
                if room > 0:
                    self._children(tree, parent, logits[i, j], min(self.shape.width, room), depth)
            tree.frontier = self._next_frontier(tree, depth) if depth < self.shape.depth else []
        return any(tree.frontier for tree in self.trees)

    def feed(self) -> tuple[torch.Tensor, list[list[int]], torch.Tensor, torch.Tensor]:
        """The next expansion forward: token ids [B, w] (target ids; 0 at padding), each row's
        fed nodes, their depths [B, w] (position offsets from the root's) and the attention
        mask [B, w, T] (True: attend) over every column so far, this forward's included."""
        w = self.shape.width
        first = self.base + self.forwards * w
        self.forwards += 1
        ids = torch.zeros(len(self.trees), w, dtype=torch.long)
        depths = torch.ones(len(self.trees), w, dtype=torch.long)
        allowed = torch.zeros(len(self.trees), w, first + w, dtype=torch.bool)
        if self.committed is None:
            allowed[:, :, : self.base] = True
        else:
            allowed[:, :, : self.base] = self.committed[:, None, : self.base]
        for i, tree in enumerate(self.trees):
            for j, node in enumerate(tree.frontier):
                tree.column[node] = first + j
                ids[i, j], depths[i, j] = tree.tokens[node], tree.depths[node]
                for kin in tree.ancestors(node):
                    allowed[i, j, tree.column[kin]] = True
            for j in range(len(tree.frontier), w):  # padding sees itself only (never NaN)
                allowed[i, j, :] = False
                allowed[i, j, first + j] = True
        return ids, [list(t.frontier) for t in self.trees], depths, allowed

    def finish(self) -> None:
        """Prune greedy rows to the node budget (best cumulative probability first)."""
        for tree in self.trees:
            if tree.params.greedy and len(tree.tokens) > self.shape.nodes:
                _prune(tree, self.shape.nodes)

    # ------------------------------------------------------------------ drawing

    def _room(self, tree: GrownTree) -> int:
        """Nodes a row may still draw: a sampled row stops at the budget (checked before the
        children are drawn); a greedy one draws every expansion and is pruned at the end."""
        if tree.params.greedy:
            return self.shape.width
        return self.shape.nodes - len(tree.tokens)

    def _children(
        self, tree: GrownTree, parent: int, logits: torch.Tensor, count: int, depth: int
    ) -> None:
        """``count`` children of ``parent`` drawn from the draft's ``logits`` [V or K]."""
        base = 0.0 if parent == ROOT else tree.scores[parent]
        if tree.params.greedy:
            logq = torch.log_softmax(logits.float(), dim=-1)
            drawn = torch.topk(logq, min(count, logq.shape[-1])).indices
            q = None
        else:
            q = sampling.probs_from_logits(logits, tree.params)
            drawn = sampling.draw_children(q, count, tree.generator)
            logq = q.clamp_min(1e-30).log()
        targets = drawn if self.vocab is None else self.vocab.to_target(drawn)
        for token, target in zip(drawn.tolist(), targets.tolist(), strict=True):
            tree.tokens.append(int(target))
            tree.parents.append(parent)
            tree.depths.append(depth)
            tree.scores.append(base + float(logq[token]))
            if q is not None:
                tree.q_rows.append(q)

    def _next_frontier(self, tree: GrownTree, depth: int) -> list[int]:
        """The ``width`` best nodes at ``depth`` (their children come next), while the budget
        leaves room for any; sampled rows grow only up to the budget, greedy ones beyond it
        and are pruned at the end (:meth:`finish`)."""
        if not tree.params.greedy and len(tree.tokens) >= self.shape.nodes:
            return []
        deepest = [n for n, d in enumerate(tree.depths) if d == depth]
        deepest.sort(key=lambda n: (-tree.scores[n], n))
        return deepest[: self.shape.width]


def _prune(tree: GrownTree, nodes: int) -> None:
    """Keep the ``nodes`` best nodes by score (ties: the earlier), re-indexed in their order."""
    best = sorted(range(len(tree.tokens)), key=lambda n: (-tree.scores[n], n))[:nodes]
    keep = sorted(best)
    kept = set(keep)
    if any(tree.parents[n] != ROOT and tree.parents[n] not in kept for n in keep):
        raise AssertionError("pruning kept a node without its parent")
    index = {old: new for new, old in enumerate(keep)}
    tree.parents = [ROOT if tree.parents[n] == ROOT else index[tree.parents[n]] for n in keep]
    tree.tokens = [tree.tokens[n] for n in keep]
    tree.depths = [tree.depths[n] for n in keep]
    tree.scores = [tree.scores[n] for n in keep]
