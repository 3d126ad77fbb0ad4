"""What an emulated target accepts of a proposal: an acceptance process instead of a forward.

* A chain of gamma draft tokens: each is accepted with probability ``alpha``, in order, until
  the first rejection (i.i.d. positions).
* A token tree (``starsd.tree``; a node's children listed in the draft's order of preference):
  from the root, the target's next token is the first listed child with probability ``alpha``
  (so a tree of width 1 is the chain above); when it is not, each next sibling in turn is with
  probability ``sibling_alpha``, the chance the draft's runner-up choice holds the token its
  first choice missed. The path goes on from the matched child, and stops where no child
  matches. ``sibling_alpha`` is the emulation's assumption about the draft, as ``alpha`` is;
  the default is fitted to the trees measured on the real pair (docs/benchmarks.md). The
  model's expectation of the same process: :func:`starsd.analytic.expected_tree_tokens`.
Pure: no clock, no sockets.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from starsd import tree
from starsd.analytic import SIBLING_ALPHA  # the model's default, fitted to the real pair

__all__ = ["SIBLING_ALPHA", "accepted_count", "accepted_path"]


def accepted_count(rng: random.Random, alpha: float, gamma: int) -> int:
    """Accepted drafts of one round when each is accepted with probability alpha, in order."""
    n = 0
    while n < gamma and rng.random() < alpha:
        n += 1
    return n


def accepted_path(
    rng: random.Random, alpha: float, sibling_alpha: float, parents: Sequence[int]
) -> list[int]:
    """The accepted path's nodes (root side first) through the tree of ``parents``."""
    kids, row, path = tree.children(parents), 0, list[int]()
    while True:
        node = _matched_child(rng, alpha, sibling_alpha, kids[row])
        if node is None:
            return path
        path.append(node)
        row = node + 1


def _matched_child(
    rng: random.Random, alpha: float, sibling_alpha: float, children: list[int]
) -> int | None:
    """The child holding the target's token (None: none does)."""
    for rank, child in enumerate(children):
        if rng.random() < (alpha if rank == 0 else sibling_alpha):
            return child
    return None
