"""Token trees: the shape check, greedy tree verification, and the law of recursive rejection
sampling over a tree (pure; no model)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from starsd import sampling, tree

V = 5


def _law(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A root row [V] and one row per first token [V, V], random and far from uniform."""
    g = torch.Generator().manual_seed(seed)
    root = torch.rand(V, generator=g) ** 3
    rows = torch.rand(V, V, generator=g) ** 3
    return root / root.sum(), rows / rows.sum(-1, keepdim=True)


P0, P1 = _law(1)  # the target: p(x1), p(x2 | x1)
Q0, Q1 = _law(2)  # the draft


def _tree_round(gen: torch.Generator) -> list[int]:
    """One tree round: three children of the root drawn from q, two under the first child;
    verified against p; the first two tokens it emits (the second drawn from p alone when the
    round emitted one, as the target's next round would)."""
    first = sampling.draw_children(Q0, 3, gen).tolist()
    second = sampling.draw_children(Q1[first[0]], 2, gen).tolist()
    tokens, parents = [*first, *second], [-1] * len(first) + [0] * len(second)
    rows = [(P0, Q0)] + [(P1[t], Q1[t]) for t in tokens[: len(first)]]
    rows += [(P0, Q0)] * len(second)  # depth-2 nodes have no children: their rows are unread
    p_rows = torch.stack([p for p, _ in rows])
    q_rows = torch.stack([q for _, q in rows])
    path, nxt = sampling.tree_rejection_sample(tokens, parents, q_rows, p_rows, gen)
    emitted = [tokens[n] for n in path] + [nxt]
    if len(emitted) == 1:
        emitted.append(int(sampling.sample(P1[emitted[0]][None], gen)[0]))
    return emitted[:2]


def _p_value(trials: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        a, b = _tree_round(gen)
        counts[a, b] += 1
    expected = (P0[:, None] * P1).reshape(-1) * trials
    keep = expected > 5
    observed = counts.reshape(-1)[keep]
    return float(
        stats.chisquare(
            observed.numpy(), (expected[keep] * observed.sum() / expected[keep].sum()).numpy()
        ).pvalue
    )


def test_tree_rounds_emit_exactly_the_targets_law() -> None:
    """Catches a tree rule that is not lossless: a wrong acceptance ratio, a sibling tried
    against the original q instead of q without the earlier siblings, the wrong row read after
    an accepted child, or the bonus drawn from the wrong row; the joint law of the first two
    emitted tokens must be p(x1) p(x2 | x1) (chi-square over 25 cells)."""
    assert _p_value(6000, seed=7) > 1e-3


def test_a_rule_without_the_residual_update_fails_the_law_test(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The law test has power: with no residual update after a rejected sibling (each
    sibling tried against p itself, SpecInfer's rule without its residual) the emitted law
    is not p's, and the same test rejects it."""
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    assert _p_value(6000, seed=7) < 1e-6


def test_children_are_distinct_draws_in_drawing_order() -> None:
    """Catches children drawn with replacement (a repeated sibling wastes a node) or more
    children than q's support; and a first child that is not a draw from q (its frequency
    over many draws must follow q)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    firsts = torch.zeros(V)
    for _ in range(4000):
        kids = sampling.draw_children(q, 4, gen).tolist()
        assert len(kids) == len(set(kids)) == 3 and 1 not in kids and 4 not in kids
        firsts[kids[0]] += 1
    assert stats.chisquare(firsts[[0, 2, 3]].numpy(), (q[[0, 2, 3]] * 4000).numpy()).pvalue > 1e-3


def test_greedy_tree_verification_follows_the_targets_argmax() -> None:
    """Catches a greedy walk that stops at the first child instead of trying its siblings,
    follows a child that is not the argmax, or returns the wrong next token; and a chain (a
    tree of width 1) verified differently from the chain rule."""
    logits = torch.full((6, V), -1.0)
    for row, best in enumerate([3, 0, 2, 4, 1, 0]):  # the argmax after row's node
        logits[row, best] = 1.0
    tokens, parents = [1, 3, 4, 2, 0], [-1, -1, -1, 1, 1]  # root: 1, 3, 4; node 1 (3): 2, 0
    assert sampling.greedy_tree_verify(tokens, parents, logits) == ([1, 3], 1)  # 3, then 2
    chain = [3, 4, 1]
    chain_logits = torch.full((4, V), -1.0)
    for row, best in enumerate([3, 4, 2, 0]):
        chain_logits[row, best] = 1.0
    accepted, nxt = sampling.greedy_verify(torch.tensor(chain), chain_logits)
    path, tree_nxt = sampling.greedy_tree_verify(chain, [-1, 0, 1], chain_logits)
    assert (len(path), tree_nxt) == (accepted, nxt) == (2, 2)


@pytest.mark.parametrize(
    ("parents", "problem"),
    [
        ([-1, 0, 5], "node 2 names parent 5"),
        ([-1, 1], "node 1 names parent 1"),
        ([0], "node 0 names parent 0"),
        ([-2], "node 0 names parent -2"),
        ([-1] * 9, "9 tree nodes exceed the limit of 8"),
    ],
)
def test_a_malformed_tree_is_named(parents: list[int], problem: str) -> None:
    """Catches cycles, forward references, out-of-range parents and an over-budget tree
    getting past the check (a cycle would loop the target's walk forever)."""
    assert problem in (tree.tree_problem(parents, 8) or "")
    assert tree.tree_problem([-1, 0, 0, 1, -1], 8) is None
