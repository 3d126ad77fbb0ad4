"""Token trees under emulation: what an emulated drafter proposes and costs, what an emulated
target accepts, the model's tree round, and the scale suite's tree comparison."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import serving_hub
from scipy import stats as scipy_stats

from scripts.bench import trees as bench_trees
from scripts.emulate.acceptance import accepted_path
from scripts.emulate.config import EmulationConfig
from scripts.emulate.emulated import emulate
from starsd import analytic, tree
from starsd import hub as hub_module
from starsd.hub.drafters.base import DraftJob, new_chain_state
from starsd.hub.drafters.emulated import EmulatedProposer
from starsd.hub.drafters.tree_draft import GrownTree, TreeBatch
from starsd.protocol import Proposal, SamplingParams
from starsd.service import ServiceCurve
from starsd.tree_shapes import CHOICE_WEIGHT, TreeShape, ranked_tree

# a(B) = 1 ms + 0.1 ms per row, b(B) = 0.5 ms + 0.05 ms per row, measured at B = 1 and 64
CURVE = ServiceCurve((1, 64), (1e-3, 7.3e-3), (0.5e-3, 3.65e-3))


def test_a_tree_costs_its_feed_then_one_forward_per_depth_over_its_expanded_nodes() -> None:
    """Catches a tree costed as a chain of its node count (8 steps), as a chain of its depth
    (the expansion forwards carry width rows per tree), or with the feed over B * width rows."""
    feed, expand = CURVE.costs_of(4)[0], CURVE.costs_of(8)[1]
    assert CURVE.tree_at(4, 2, 4) == pytest.approx(feed + 3 * expand)
    assert CURVE.tree_at(4, 1, 4) == pytest.approx(CURVE.at(4, 4))  # width 1: a chain
    assert CURVE.tree_at(4, 2, 4) > CURVE.at(4, 4)


def test_the_emulated_tree_is_the_tree_a_draft_grows() -> None:
    """Catches an emulated tree the hub could not send (parents after children, repeated
    siblings, over the node budget, deeper than asked) or one unlike EAGLE-2's (the first
    choice's line kept deepest; width 1 a chain)."""
    for shape in (TreeShape(2, 4, 8), TreeShape(3, 4, 12), TreeShape(2, 5, 32), TreeShape(4, 2, 3)):
        tokens, parents = ranked_tree(shape)
        assert tree.tree_problem(parents, shape.nodes) is None
        assert tree.sibling_problem(tokens, parents) is None
        assert max(tree.depths(parents)) <= shape.depth
        grown = shape.width + shape.width**2 * (shape.depth - 1)  # before pruning
        assert len(parents) == min(shape.nodes, grown)
        assert tree.path_to(parents, len(parents) - 1)[0] == 0  # the deepest node: first choice
    assert ranked_tree(TreeShape(1, 4, 4)) == ((0, 0, 0, 0), tree.chain(4))
    assert ranked_tree(TreeShape(2, 3, 6)) == ((0, 1, 0, 1, 0, 0), (-1, -1, 0, 0, 1, 2))


# the real pair's measured trees that scripts.emulate.acceptance.SIBLING_ALPHA was fitted on
FITTED_SHAPES = (TreeShape(2, 3, 6), TreeShape(2, 4, 8), TreeShape(3, 4, 12))


@pytest.mark.parametrize(
    "shape",
    [
        TreeShape(2, 4, 8),
        TreeShape(2, 3, 4),
        TreeShape(2, 3, 6),
        TreeShape(3, 4, 12),
        TreeShape(4, 5, 24),
        TreeShape(8, 4, 32),
        TreeShape(4, 6, 32),
        TreeShape(2, 5, 32),
        TreeShape(1, 4, 4),
    ],
)
def test_the_ranked_tree_is_what_the_hubs_growth_makes_of_those_choices(shape: TreeShape) -> None:
    """Catches the model's tree (pure, for the planner and the emulated drafter) drifting from
    the hub's drafting (TreeBatch: EAGLE-2's frontier and pruning): fed logits that weigh each
    next choice CHOICE_WEIGHT of the one before, the real growth keeps as many nodes of each
    depth and path-rank sum (the draft's score), and for the shapes the emulated acceptance was
    fitted on, the same tree. (Not node for node everywhere: paths of equal rank sums tie
    exactly, which TreeBatch's float32 running sums break by rounding, the model by its rule,
    the earlier node; such nodes need not be equally likely to be accepted.)"""
    weights = [math.log(CHOICE_WEIGHT) * k for k in range(shape.width)]
    choices = torch.tensor(weights, dtype=torch.float32)  # [width] logits, best first
    grown = GrownTree(SamplingParams(), torch.Generator())
    trees = TreeBatch([grown], shape, committed_columns=0, committed=None)
    depth = 1
    while trees.grow(choices.expand(1, shape.width, -1), depth):
        depth += 1
    trees.finish()
    tokens, parents = ranked_tree(shape)
    assert _nodes_by_rank(tokens, parents) == _nodes_by_rank(grown.tokens, grown.parents)
    if shape in FITTED_SHAPES:
        assert (tokens, parents) == (tuple(grown.tokens), tuple(grown.parents))


def _nodes_by_rank(tokens: Sequence[int], parents: Sequence[int]) -> Counter[tuple[int, int]]:
    """(depth, sum of the path's choice ranks) of every node (token k: the k-th choice)."""
    return Counter(
        (len(path), sum(tokens[n] for n in path))
        for path in (tree.path_to(list(parents), node) for node in range(len(parents)))
    )


def _job(state, accepted: int = 0, path: tuple[int, ...] | None = None) -> DraftJob:
    return DraftJob(b"t", 1, state, accepted, (7,), path=path)


def test_the_emulated_proposer_drafts_trees_and_costs_chain_and_tree_rows_apart() -> None:
    """Catches an emulated drafter that proposes a chain where the pacer chose a tree, commits
    a tree's verdict as its first ``accepted`` nodes instead of its path (also when the round
    that verdict asks for is a chain), or costs a batch of both shapes as one forward (the
    real drafters run a batch's chain rows and tree rows apart)."""
    proposer, shape = EmulatedProposer(CURVE), TreeShape(2, 4, 8)
    states = [new_chain_state([1, 2, 3], SamplingParams(), 4) for _ in range(5)]
    for state in states[2:]:
        state.tree = shape
    results = proposer.propose([_job(s) for s in states])
    assert [r.parents is None for r in results] == [True, True, False, False, False]
    tokens, parents = ranked_tree(shape)
    assert results[2].parents.tolist() == list(parents)
    assert results[2].tokens.tolist() == list(tokens)
    want = CURVE.at(2, 4) + CURVE.tree_at(3, 2, 4)
    assert proposer.cost(states) == pytest.approx(want)
    assert proposer.cost(states) > CURVE.at(5, 4)
    assert parents[4] == 1  # path (1, 4): the root's second choice, then its first
    proposer.propose([_job(states[2], accepted=2, path=(1, 4))])
    assert states[2].tokens[4:] == [tokens[1], tokens[4], 7] == [1, 0, 7]
    states[2].tree = None  # the pacer's next round: a chain, after that tree's verdict
    proposer.propose([_job(states[2], accepted=2, path=(1, 4))])
    assert states[2].tokens[7:] == [1, 0, 7]  # the path again, not proposed[:2] = [0, 1]


def test_the_emulated_acceptance_follows_its_law_and_the_model() -> None:
    """Catches an emulated target whose tree acceptance is not the documented process (the
    runner-up tried with alpha, or before the first child) and a model E[L] that differs from
    it: paths through a two-child root counted against their law (chi-square), and the mean
    tokens of a grown tree against :func:`starsd.analytic.expected_tree_tokens`."""
    rng, alpha, sibling = random.Random(3), 0.6, 0.3
    star = [-1, -1]
    counts = Counter(tuple(accepted_path(rng, alpha, sibling, star)) for _ in range(4000))
    law = {(0,): alpha, (1,): (1 - alpha) * sibling, (): (1 - alpha) * (1 - sibling)}
    observed = [counts[k] for k in law]
    expected = [4000 * p for p in law.values()]
    assert scipy_stats.chisquare(observed, expected).pvalue > 1e-3
    _, parents = ranked_tree(TreeShape(2, 4, 8))
    mean = statistics.mean(
        1 + len(accepted_path(rng, alpha, sibling, parents)) for _ in range(20000)
    )
    assert mean == pytest.approx(analytic.expected_tree_tokens(alpha, sibling, parents), abs=0.03)
    chain = tree.chain(4)
    assert analytic.expected_tree_tokens(alpha, sibling, chain) == pytest.approx(
        analytic.expected_tokens_per_round(alpha, 4)
    )


def test_the_model_drafts_a_tree_round_at_its_cost_and_tokens() -> None:
    """Catches a model that keeps the chain's service time or E[L] for tree rounds, and a JSON
    round trip that drops the tree."""
    base = analytic.ModelInputs(0.7, 4, 4e-3, 6e-3, 5e-4, 6e-3, max_batch=64, curve=CURVE)
    trees = analytic.ModelInputs(
        0.7, 4, 4e-3, 6e-3, 5e-4, 6e-3, 64, CURVE, tree=analytic.TreeRound(2, 4, 3.2)
    )
    one = analytic.predict(trees, 1)
    assert one.iteration_s == pytest.approx(CURVE.tree_at(1, 2, 4) + 6e-3 + 5e-4)
    assert one.per_target_tokens_per_s == pytest.approx(3.2 / one.iteration_s)
    assert analytic.predict(base, 1).per_target_tokens_per_s != one.per_target_tokens_per_s
    assert analytic.inputs_from_json(analytic.inputs_as_json(trees)).tree == trees.tree
    with pytest.raises(ValueError, match="tree"):
        analytic.ModelInputs(0.7, 4, 4e-3, 6e-3, 5e-4, 6e-3, tree=analytic.TreeRound(2, 4, 3.2))


def _report(n: int, tokens_per_s: float, trees: float) -> dict:
    return {
        "n_targets": n,
        "system_tokens_per_s": tokens_per_s,
        "tree_fraction": trees,
        "runs_tokens_per_s": [tokens_per_s],
    }


def test_the_tree_comparison_holds_auto_to_chains_at_every_n() -> None:
    """Catches a summary that compares auto with the best of all modes (trees forced can win
    where the policy rightly keeps chains), averages the N instead of taking the worst, or
    a model that keeps trees on a fully loaded hub."""
    reports = {
        bench_trees.mode_name(bench_trees.CHAINS): [_report(1, 100, 0), _report(64, 1000, 0)],
        bench_trees.mode_name(bench_trees.AUTO): [_report(1, 120, 0.9), _report(64, 940, 0.1)],
        bench_trees.mode_name(bench_trees.ON): [_report(1, 125, 1), _report(64, 600, 1)],
    }
    summary = bench_trees.compare(reports, None, None)
    assert summary["by_n"]["1"]["auto_over_chains"] == pytest.approx(1.2)
    assert summary["min_auto_over_chains"] == pytest.approx(0.94) and not summary["all_ok"]
    base = analytic.ModelInputs(0.7, 4, 4e-3, 6e-3, 5e-4, 6e-3, max_batch=64, curve=CURVE)
    trees = bench_trees.tree_inputs(base, reports, TreeShape(2, 4, 8))
    assert trees.tree is not None and trees.tree.tokens_per_round > 1
    loaded = bench_trees.model_at(base, trees, 100_000)
    assert loaded["tree_regime"] == "fully-loaded" and not loaded["auto_picks_trees"]
    assert loaded["tokens_per_s"]["auto"] == loaded["tokens_per_s"]["chains"]


@pytest.mark.parametrize("announced", [8, 0])
async def test_emulated_targets_verify_the_trees_an_emulated_hub_drafts(
    tmp_path: Path, llama_pair: tuple[Path, Path], announced: int
) -> None:
    """Catches the emulation's trees failing on the wire (the hub refusing an emulated
    target's path, a target not announcing trees) and a hub that sends trees to targets that
    announced none: under --tree on, targets announcing trees get one every round, and every
    round commits more than the target's own token on average."""
    from test_profile import draft_raw, write

    config = hub_module.HubConfig(
        model=str(llama_pair[1]),
        bind="tcp://127.0.0.1:*",
        stats_interval=3600,
        draft_kind="emulated",
        draft_profile=write(tmp_path, "d.json", draft_raw(a_ms=0.5, b_ms=0.2)),
        tree="on",
    )
    async with serving_hub(config) as running:
        cfg = EmulationConfig(
            hub=running.endpoint,
            targets=2,
            alpha=0.6,
            verify_ms=2.0,
            duration=0.6,
            warmup=0.2,
            calibration=0.2,
            model=str(llama_pair[0]),
            tree_nodes=announced,
        )
        report = await emulate(cfg)
    assert report["rounds"] > 0 and report["sequence_errors"] == 0
    if announced:
        assert report["tree_fraction"] == 1.0
        assert report["tokens_per_tree_round"] > 1.5
    else:
        assert report["tree_rounds"] == 0 and report["mean_gamma"] > 1


async def test_the_emulated_proposer_refuses_to_sleep_on_an_event_loop() -> None:
    """Catches the emulated drafter's sleep run on an event loop (a hub that drafted there
    would stall every target's messages for each batch's drafting time)."""
    proposer = EmulatedProposer(CURVE)
    job = _job(new_chain_state([1, 2, 3], SamplingParams(), 4))
    with pytest.raises(RuntimeError, match="worker thread"):
        proposer.propose([job])
    (result,) = await asyncio.to_thread(proposer.propose, [job])
    assert isinstance(result, Proposal) and len(result.tokens) == 4
