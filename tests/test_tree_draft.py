"""Token trees on the hub: how a tree grows (pure), each proposer's tree against an oracle that
drafts every node's path from scratch, sampled trees' laws, a verdict's path checked against
the tree, and the tree-or-chain rule."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from greedy import assert_greedy
from test_drafting import eagle_oracle, greedy_oracle, head  # noqa: F401  (head: a fixture)
from test_eagle_hub import _two_token_law, greedy_alone, law_pvalue, trained_hub  # noqa: F401  (a fixture)

from edge.backends.torch import TorchBackend
from edge.verifier import TargetSequence
from starsd import hub as hub_module
from starsd import models, sampling, tree
from starsd.hub.drafters import eagle_head as eagle
from starsd.hub.drafters.base import DraftJob, Proposer
from starsd.hub.drafters.eagle import EagleProposer
from starsd.hub.drafters.llm import LlmProposer
from starsd.hub.drafters.tree_draft import GrownTree, TreeBatch
from starsd.hub.sessions import path_problem
from starsd.hub.shapes import MIN_PHASE, PHASE_ROUNDS, ShapeChooser
from starsd.protocol import Proposal, SamplingParams
from starsd.tree_shapes import ROOT, TreeShape, tree_ladder

PROMPTS = [[5, 17, 33, 8], [3, 4, 9], [21, 22, 23, 24, 25, 26, 27]]
# a draft LLM in StarSD's own Llama forward, in transformers' Llama, in transformers' GPT-2
DRAFT_FORWARDS = ["starsd-llama", "transformers-llama", "transformers-gpt2"]


# ---------------------------------------------------------------------------------- pure growth


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()  # [V]


def test_the_best_paths_are_expanded_and_a_greedy_tree_is_pruned_to_the_budget() -> None:
    """Catches expanding the wrong nodes (not the best cumulative path probability), children
    not the draft's top tokens, a node fed without its ancestors in its mask, and pruning that
    keeps a node without its parent or more nodes than the budget."""
    grown = GrownTree(SamplingParams(), torch.Generator())
    batch = TreeBatch([grown], TreeShape(width=2, depth=2, nodes=4), 3, None)
    assert batch.grow(_logits([0.1, 0.6, 0.3, 0.0])[None, None], 1)  # root: tokens 1, 2
    assert grown.tokens == [1, 2] and grown.parents == [ROOT, ROOT]
    ids, fed, depths, allowed = batch.feed()
    assert fed == [[0, 1]] and ids.tolist() == [[1, 2]] and depths.tolist() == [[1, 1]]
    assert allowed[0].tolist() == [[True] * 3 + [True, False], [True] * 3 + [False, True]]
    # node 0 (p 0.6) -> 0.9 on token 3; node 1 (p 0.3) -> 0.6 / 0.4 on tokens 0, 1
    children = torch.stack([_logits([0.06, 0.04, 0.0, 0.9]), _logits([0.6, 0.4, 0.0, 0.0])])
    assert not batch.grow(children[None], 2)  # the deepest depth: no more forwards
    batch.finish()
    # scores: 1: .6, 2: .3, 1-3: .54, 1-0: .036, 2-0: .18, 2-1: .12 -> keep the 4 best
    assert [grown.tokens[n] for n in range(4)] == [1, 2, 3, 0]
    assert grown.parents == [ROOT, ROOT, 0, 1]
    assert tree.tree_problem(grown.parents, 4) is None


def test_a_sampled_tree_draws_distinct_siblings_from_the_parents_law_within_the_budget() -> None:
    """Catches siblings drawn with replacement (a repeat), a node's q that is not its parent's
    law (recursive rejection sampling would be biased), and a sampled tree grown past its
    budget and pruned afterwards (which would keep siblings by their own values)."""
    grown = GrownTree(SamplingParams(temperature=1.0), torch.Generator().manual_seed(3))
    shape = TreeShape(width=3, depth=3, nodes=7)
    batch = TreeBatch([grown], shape, 2, None)
    logits = torch.randn(1, 1, 50, generator=torch.Generator().manual_seed(1))
    depth = 1
    while batch.grow(logits, depth):
        batch.feed()
        logits = torch.randn(1, shape.width, 50)
        depth += 1
    batch.finish()
    assert len(grown.tokens) == 7 and tree.tree_problem(grown.parents, 7) is None
    for parent, kids in enumerate(tree.children(grown.parents)):
        tokens = [grown.tokens[k] for k in kids]
        assert len(set(tokens)) == len(tokens), f"row {parent} repeats a sibling"
        for k in kids:
            assert torch.equal(grown.q_rows[k], grown.q_rows[kids[0]])
            assert float(grown.q_rows[k][grown.tokens[k]]) > 0


# ---------------------------------------------------------------------------------- proposers


def _tree_jobs(proposer: Proposer, shape: TreeShape, params: SamplingParams) -> list[DraftJob]:
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        state = proposer.new_state(prompt, params, 3)
        state.tree = shape
        jobs.append(DraftJob(b"%d" % i, 0, state, 0, ()))
    return jobs


def _paths(result: Proposal) -> list[list[int]]:
    """Each node's path of tokens (root side first)."""
    parents = result.parents.tolist()
    tokens = result.tokens.tolist()
    return [[tokens[n] for n in tree.path_to(parents, node)] for node in range(len(tokens))]


@pytest.mark.parametrize(
    ("family", "lean"), [("llama", True), ("llama", False), ("gpt2", False)], ids=DRAFT_FORWARDS
)
def test_a_draft_llm_tree_holds_each_nodes_top_children_given_its_path_alone(
    family: str, lean: bool, request: pytest.FixtureRequest
) -> None:
    """Catches a draft forward whose tree mask lets a node see its siblings or cousins, wrong
    tree positions (RoPE; GPT-2's learned positions), rows of a batch leaking into each other,
    and a cache left holding tree keys: every expanded node's children are the top tokens of a
    fresh forward of the prompt + its path alone, for three sessions drafted in one batch, over
    two rounds; in StarSD's attention and in transformers' (the tree mask given as 4D)."""
    pair = request.getfixturevalue(f"{family}_pair")
    draft = models.load_causal_lm(pair[1], lean=lean)
    proposer = LlmProposer(draft)
    shape = TreeShape(width=2, depth=3, nodes=14)  # 2 + 4 + 4 drawn: nothing pruned
    jobs = _tree_jobs(proposer, shape, SamplingParams())
    for _round in range(2):
        results = proposer.propose(jobs)
        for job, result in zip(jobs, results, strict=True):
            assert isinstance(result, Proposal) and result.parents is not None
            _check_children(result, lambda path, job=job: _llm_top(draft, job, path, 2))
        jobs = [
            DraftJob(j.tag, j.seq + 1, j.state, 1, (7,), path=(0,))
            for j, r in zip(jobs, results, strict=True)
        ]
        assert jobs[0].state.cache.length == len(jobs[0].state.tokens)


def _llm_top(draft: models.LoadedModel, job: DraftJob, path: list[int], k: int) -> list[int]:
    logits = models.forward(draft, [*job.state.tokens, *path], models.new_cache(draft))[-1]
    return torch.topk(logits, k).indices.tolist()


def _check_children(result: Proposal, top: object) -> None:
    """Each node with children has the oracle's top tokens as its children, in order."""
    parents, tokens = result.parents.tolist(), result.tokens.tolist()
    paths = _paths(result)
    for row, kids in enumerate(tree.children(parents)):
        if kids:
            path = [] if row == 0 else paths[row - 1]
            assert [tokens[k] for k in kids] == top(path)[: len(kids)], f"row {row}"  # type: ignore[operator]


def test_an_eagle_tree_holds_each_nodes_top_children_given_its_path_alone(
    head: eagle.LoadedEagle,  # noqa: F811
) -> None:
    """The same for the EAGLE head: catches a node fed another node's predicted feature (its
    parent's is the one), a tree mask ignored by the head's attention, and wrong positions;
    the oracle is the head's single-sequence path along each node's path."""
    proposer = EagleProposer(head, 256)
    shape = TreeShape(width=2, depth=3, nodes=14)
    width = head.config.hidden_size
    rng = torch.Generator().manual_seed(0)
    jobs, features = [], []
    for i, prompt in enumerate(PROMPTS):
        state = proposer.new_state(prompt, SamplingParams(), 3)
        state.tree = shape
        features.append(torch.randn(len(prompt) - 1, width, generator=rng).half().float())
        jobs.append(DraftJob(b"%d" % i, 0, state, 0, (), features=features[-1].numpy()))
    results = proposer.propose(jobs)
    for job, feats, result in zip(jobs, features, results, strict=True):
        assert isinstance(result, Proposal) and result.parents is not None

        def top(path: list[int], job: DraftJob = job, feats: torch.Tensor = feats) -> list[int]:
            rows = eagle_oracle(head, job.state.tokens, feats, [*path, 0])
            return torch.topk(rows[-1], 2).indices.tolist()

        _check_children(result, top)


def test_a_chain_session_beside_tree_sessions_drafts_its_chain(
    llama_pair: tuple[Path, Path],
) -> None:
    """Catches a batch that drafts every row as a tree once one row asks for it (or the
    reverse): a chain row in the same propose call still gets its greedy chain."""
    draft = models.load_causal_lm(llama_pair[1])
    proposer = LlmProposer(draft)
    jobs = _tree_jobs(proposer, TreeShape(2, 2, 6), SamplingParams())
    jobs[1].state.tree = None
    results = proposer.propose(jobs)
    assert results[1].parents is None
    assert results[1].tokens.tolist() == greedy_oracle(draft, PROMPTS[1], 3)
    assert results[0].parents is not None and results[2].parents is not None


# ---------------------------------------------------------------------------------- verdicts


def test_a_verdicts_path_must_be_a_root_path_of_the_tree_it_answers() -> None:
    """Catches a hub that commits a path that is not in the tree (a node skipped, a sibling's
    child, out of range), a path of another length than accepted, or a path sent after a
    chain: each is refused, the rest accepted."""
    parents = (ROOT, ROOT, 0, 0, 3)
    ok = [(parents, [0, 3, 4], 3), (parents, [1], 1), (parents, [], 0), (None, None, 2)]
    for tree_parents, path, accepted in ok:
        array = None if path is None else np.asarray(path, dtype=np.int32)
        assert path_problem(tree_parents, array, accepted) is None
    bad = [
        (parents, [0, 4], 2),  # skips node 3
        (parents, [1, 2], 2),  # node 2 is node 0's child
        (parents, [9], 1),  # out of range
        (parents, [0, 3], 3),  # shorter than accepted
        (None, [0], 1),  # a path after a chain
    ]
    for tree_parents, path, accepted in bad:
        array = np.asarray(path, dtype=np.int32)
        assert path_problem(tree_parents, array, accepted) is not None


class _Rounds:
    """Rounds of a hub's sessions against a :class:`ShapeChooser`, on a clock of their own:
    each round lasts 1 s and the sessions run at once, so rounds end 1 / sessions s apart."""

    def __init__(self, options: int = 2) -> None:
        self.chooser, self.now = ShapeChooser(options), 0.0

    def run(self, sessions: int, rate: dict[int, float], rounds: int) -> str:
        """``rounds`` rounds, each observed at ``rate`` tokens/s for its option (True: the
        first tree); the options drafted, "c" a chain, "t" the first tree, "u" the second."""
        drafted = ""
        for _ in range(rounds):
            option, phase = self.chooser.use_shape(loaded=False, now=self.now)
            self.chooser.observe(option, (phase, phase), int(rate[option]), 1.0)
            self.now += 1.0 / sessions
            drafted += "ctu"[option]
        return drafted

    def phase(self, sessions: int, rate: dict[int, float]) -> str:
        """One phase's worth of rounds once the chooser knows the load."""
        return self.run(sessions, rate, _phase(sessions))


def _phase(sessions: int) -> int:
    """A phase's rounds with ``sessions`` in flight: PHASE_ROUNDS each, at least MIN_PHASE."""
    return max(PHASE_ROUNDS * sessions, MIN_PHASE)


def test_the_hub_tries_both_shapes_in_phases_then_keeps_the_faster() -> None:
    """Catches sessions deciding apart (a chain verified beside a tree costs what the tree
    does, and a batch of both shapes drafts both), phases not sized by the rounds in flight
    (PHASE_ROUNDS each), a rule that never tries trees (or chains), ignores the measured tokens
    per second, flaps between near-equal shapes, retries a losing shape at a fixed rate, or
    counts a round drafted outside the phases (on a loaded hub)."""
    hub, faster_trees = _Rounds(), {True: 30, False: 20}
    assert hub.run(3, faster_trees, MIN_PHASE) == "c" * MIN_PHASE  # chains first
    assert hub.phase(3, faster_trees) == "t" * _phase(3)  # every session alike
    # the trees' rounds are folded once the next phase has ended (their verdicts are back)
    assert hub.phase(3, faster_trees) == "c" * _phase(3)
    assert hub.phase(3, faster_trees) == "t" * _phase(3)  # trees won
    chooser = hub.chooser
    chooser.observe(True, (-1, -1), 1000, 1.0)  # a chain phase's loaded round: not counted
    hub.phase(3, faster_trees)
    hub.phase(3, faster_trees)
    assert chooser.goodput[True] < 100
    for _ in range(20):  # chains now 33 tok/s, within 15% of trees' 30: trees stay
        hub.phase(3, {True: 30, False: 33})
    assert chooser.best
    shapes = [hub.phase(3, {True: 1, False: 40})[0] for _ in range(200)]
    assert not chooser.best and shapes[-20:].count("t") <= 1
    assert 2 <= shapes[20:].count("t") <= 5  # retries of losing trees: further and further apart


def test_the_hub_picks_the_tree_size_that_makes_the_most_tokens_per_second() -> None:
    """Catches a rule that compares only a chain with one tree (a smaller tree that wins is
    never drafted), that keeps the first tree beating chains when a smaller one beats it, or
    whose retries skip a loser (a tree size that starts winning is never found): every option
    is tried once, the best runs, and each loser is retried in turn."""
    hub, smaller_wins = _Rounds(3), {0: 20, 1: 25, 2: 32}
    trials = hub.run(3, smaller_wins, MIN_PHASE + 2 * _phase(3))
    assert trials == "c" * MIN_PHASE + "t" * _phase(3) + "u" * _phase(3)  # each in turn
    shapes = [hub.phase(3, smaller_wins)[0] for _ in range(120)]
    assert hub.chooser.best == 2 and shapes[-1] == "u"
    assert "c" in shapes[2:] and "t" in shapes[2:]  # both losers retried
    first_wins = {0: 20, 1: 60, 2: 32}  # the first tree now beats the smaller: found on its retry
    later = [hub.phase(3, first_wins)[0] for _ in range(200)]
    assert hub.chooser.best == 1 and later[-20:].count("t") >= 18


def test_a_chooser_with_no_tree_shape_keeps_chains_through_its_retries() -> None:
    """Catches a retry that looks for a losing option where there is none (it spun forever
    once the first retry came due)."""
    chooser = ShapeChooser(1)
    for i in range(40 * MIN_PHASE):  # past several retries' due phases
        option, phase = chooser.use_shape(loaded=False, now=float(i))
        chooser.observe(option, (phase, phase), 10, 1.0)
        assert option == 0


def test_the_tree_ladder_halves_the_nodes_one_depth_shallower() -> None:
    """Catches a ladder of one shape (nothing to choose from), trees the hub cannot draft
    (a depth under 2, no more nodes than one depth's width) or more sizes than the rule tries."""
    assert tree_ladder(TreeShape(2, 4, 8)) == (TreeShape(2, 4, 8), TreeShape(2, 3, 4))
    assert tree_ladder(TreeShape(4, 6, 32)) == (
        TreeShape(4, 6, 32),
        TreeShape(4, 5, 16),
        TreeShape(4, 4, 8),
    )
    assert tree_ladder(TreeShape(3, 2, 4)) == (TreeShape(3, 2, 4),)


def test_a_re_trial_switches_only_by_a_wide_margin_then_compares_as_usual() -> None:
    """Catches switching on the one phase each shape has had since the load moved by the
    ordinary margin (a phase at the new load can still be settling: 64 sessions opening at
    once read chains 20% low), and a wide margin that outlives that comparison (trees 20%
    ahead must then win): chains stay for one more phase, then trees take over."""
    hub = _Rounds()
    hub.run(3, {True: 15, False: 20}, 400)
    moved = hub.run(12, {True: 12, False: 10}, _phase(12) * 6)
    retrial = moved.index("t" * _phase(12))
    # chains while the re-trial's rounds come back, then measured themselves after it, then
    # compared: 12 vs 10 is within 30%, so chains once more
    after = moved[retrial + _phase(12) : retrial + 3 * _phase(12)]
    assert after == "c" * 2 * _phase(12)
    assert moved.endswith("t" * _phase(12)) and hub.chooser.best


def test_a_re_trial_of_chains_as_the_load_rises_switches_by_the_usual_margin() -> None:
    """Catches a hub that keeps a tree chosen at a light load once the load rises, because the
    chains' re-trial had to beat it by the wide margin (64 emulated targets drafted 83% of a
    run's rounds as the tree chosen at 8, 0.90x chains): chains 20% ahead after the load
    quadrupled take over right after their re-trial."""
    hub = _Rounds()
    hub.run(3, {True: 30, False: 20}, 400)
    assert hub.chooser.best
    moved = hub.run(12, {True: 10, False: 12}, _phase(12) * 6)
    retrial = moved.index("c" * _phase(12))
    # the re-trial, trees while its rounds come back and measured themselves after it, then
    # chains for good
    rest = moved[retrial + 3 * _phase(12) :]
    assert rest == "c" * len(rest) and len(rest) >= 2 * _phase(12)
    assert not hub.chooser.best


def test_a_re_trial_is_compared_with_the_favoured_shape_measured_after_it() -> None:
    """Catches comparing a re-trial with the favoured shape's figure from the phase the load
    moved in (64 sessions opening at once read chains at 35 tokens/s a session, 54 a phase
    later, and a tree re-trial between the two switched the hub to trees): chains read at half
    their rate while the load settles, then at 12 against trees' 10, and stay."""
    hub = _Rounds()
    hub.run(3, {True: 15, False: 20}, 400)
    hub.run(12, {True: 10, False: 5}, _phase(3))  # the phase the load moved in: chains settling
    after = hub.run(12, {True: 10, False: 12}, 8 * _phase(12))
    assert after.count("t") == _phase(12) and not hub.chooser.best  # the re-trial only


def test_a_round_counts_when_the_sessions_round_before_was_of_its_shape() -> None:
    """Catches counting a round whose session's round before was the other shape (the target
    may have verified it beside the other shape's rows), dropping a round whose round before
    was the same shape in the phase before, and dropping the rounds of a phase whose verdicts
    come back after it ended (the long rounds: trees read 1.8x what they made)."""
    chooser = ShapeChooser()
    for i in range(MIN_PHASE):  # the chain trial, every round counted
        tree_round, phase = chooser.use_shape(loaded=False, now=float(i))
        chooser.observe(tree_round, (phase, phase), 10, 1.0)
    assert chooser.use_shape(loaded=False, now=8.0) == (True, 2)  # the tree trial
    chooser.observe(True, (2, 1), 1000, 1.0)  # its round before: a chain
    assert chooser.phases[2].counted == 0
    for _ in range(3):
        chooser.observe(True, (2, 2), 30, 1.0)
    for i in range(MIN_PHASE):  # phase 3 (chains: trees' rounds are still out)
        chooser.use_shape(loaded=False, now=9.0 + i)
    chooser.observe(True, (2, 2), 30, 3.0)  # a long tree round, back after its phase ended
    for i in range(MIN_PHASE):
        chooser.use_shape(loaded=False, now=20.0 + i)
    assert chooser.current and chooser.goodput[True] == pytest.approx(120 / 6)
    while chooser.phase < 5:  # trees again
        chooser.use_shape(loaded=False, now=30.0)
    chooser.observe(True, (5, 4), 30, 1.0)  # its round before: a tree, one phase back
    assert chooser.phases[5].counted == 1


def test_trees_that_fill_the_hub_give_way_to_chains_until_their_retry() -> None:
    """Catches a loaded hub drafting trees, and a tree figure kept from the rounds drafted
    before the hub filled (they read fast while trees halve the hub's tokens): once a tree
    phase fills the hub, chains run and trees wait for their retry, measured anew then."""
    hub, faster_trees = _Rounds(), {True: 30, False: 20}
    hub.run(3, faster_trees, MIN_PHASE + 3 * _phase(3))
    chooser = hub.chooser
    assert chooser.best and chooser.current
    assert chooser.use_shape(loaded=True, now=hub.now) == (False, -1)
    assert not chooser.best and True not in chooser.goodput
    after = hub.run(3, faster_trees, _phase(3) * 20)
    assert after[: _phase(3) * 10] == "c" * _phase(3) * 10  # chains, phase after phase
    assert "t" * _phase(3) in after and chooser.best  # the retry: trees measured anew, faster


@pytest.mark.parametrize(
    "before, after",
    [
        ({True: 15, False: 20}, {True: 4, False: 8}),  # chains stay best, both slow down
        ({True: 30, False: 20}, {True: 5, False: 10}),  # trees were best, now chains are
    ],
)
def test_a_shape_figure_from_another_load_is_measured_anew(
    before: dict[bool, float], after: dict[bool, float]
) -> None:
    """Catches comparing a shape measured at 3 sessions with one measured at 12 (every rate
    falls with the load, so a stale figure wins: a hub going from 8 to 64 targets drafted half
    its rounds as losing trees) and smoothing a figure across loads: after the load grows,
    the other shape is measured anew in one phase, then chains win for good."""
    hub = _Rounds()
    hub.run(3, before, 400)
    assert hub.chooser.best == (before[True] > before[False])
    moved = hub.run(12, after, _phase(12) * 6)
    # the rest of a phase sized for 3, the re-trial, and the favoured shape's two phases after
    # it (while its rounds come back; its own figure at the new load)
    assert moved.count("t") <= 3 * _phase(12) + _phase(3)
    assert moved[-_phase(12) * 2 :] == "c" * (_phase(12) * 2)
    assert not hub.chooser.best


@pytest.mark.parametrize("tree_rate, retried", [(5, False), (9, True)])
def test_a_shape_that_lost_by_more_than_the_load_moved_is_not_re_tried(
    tree_rate: int, retried: bool
) -> None:
    """Catches a re-trial after every load move whatever the margin the loser lost by (trees
    at half the chains' rate on a CPU target at --concurrency 8 were re-tried each time its
    sessions came and went) and one skipped where the move could have turned the comparison:
    a load falling from 8 to 5 sessions (1.6x) re-tries trees at 9 against chains' 11, not at
    5 (a figure moves with the load at most in proportion)."""
    hub = _Rounds()
    hub.run(8, {True: tree_rate, False: 11}, MIN_PHASE + 5 * _phase(8))
    assert not hub.chooser.best
    moved = hub.run(5, {True: tree_rate, False: 11}, 5 * _phase(5))
    assert ("t" * _phase(5) in moved) == retried
    assert retried or "t" not in moved


def test_sampling_a_tree_uses_the_sessions_own_generator(llama_pair: tuple[Path, Path]) -> None:
    """Catches sampled trees drawn from a global generator (a session's draws would depend on
    its batch): a session's sampled tree is the same drafted alone or beside others."""
    draft = models.load_causal_lm(llama_pair[1])
    proposer = LlmProposer(draft)
    params = SamplingParams(temperature=1.0, seed=5)
    batched = proposer.propose(_tree_jobs(proposer, TreeShape(2, 3, 6), params))
    alone = proposer.propose(_tree_jobs(proposer, TreeShape(2, 3, 6), params)[:1])
    assert batched[0].tokens.tolist() == alone[0].tokens.tolist()
    assert batched[0].parents.tolist() == alone[0].parents.tolist()
    q = sampling.dense_q(
        torch.from_numpy(alone[0].q_probs.copy()), None, draft.model.config.vocab_size
    )
    assert torch.allclose(q.sum(-1), torch.ones(len(q)), atol=1e-5)


# ---------------------------------------------------------------------------------- lossless


def _tree_rounds(hub: hub_module.Hub, seq: TargetSequence, shape: TreeShape) -> list[int]:
    """Speculate in process with ``hub``'s proposer drafting a tree every round, exactly as
    over the wire (the verdict names the accepted path); returns the path length per round."""
    taps = bool(seq.taps)
    features = seq.features(0, len(seq.prompt) - 1) if taps else None
    state = hub.proposer.new_state(list(seq.prompt), seq.params, 3)
    job = DraftJob(b"t", 0, state, 0, (), features=features)
    lengths = []
    while not seq.done:
        state.tree = shape
        (proposal,) = hub.proposer.propose([job])
        assert isinstance(proposal, Proposal) and proposal.parents is not None, proposal
        assert state.tokens == [*seq.prompt, *seq.generated]  # the hub committed the path
        tokens, parents = proposal.tokens.tolist(), proposal.parents.tolist()
        synced = seq.committed
        q = None
        if not seq.params.greedy:
            q = _dense(proposal, seq.info.vocab_size)
        accepted, appended = seq.verify(tokens, q, parents)
        kept = seq.generated[synced - len(seq.prompt) :][:accepted]
        path = tuple(tree.accepted_path(tokens, parents, kept))
        lengths.append(len(path))
        feats = seq.features(synced - 1, seq.committed - 1) if taps else None
        job = DraftJob(
            b"t", job.seq + 1, state, accepted, tuple(appended), features=feats, path=path
        )
    return lengths


def _dense(proposal: Proposal, vocab: int) -> torch.Tensor:
    support = proposal.q_support
    return sampling.dense_q(
        torch.from_numpy(proposal.q_probs.copy()),
        None if support is None else torch.from_numpy(support.astype(np.int64)),
        vocab,
    )


@pytest.fixture(scope="module")
def llm_hub(llama_pair: tuple[Path, Path]) -> hub_module.Hub:
    return hub_module.build_hub(hub_module.HubConfig(model=str(llama_pair[1]), draft_kind="llm"))


@pytest.mark.parametrize("kind", ["llm", "eagle"])
def test_greedy_through_tree_rounds_equals_the_target_alone(
    kind: str,
    llm_hub: hub_module.Hub,
    trained_hub: hub_module.Hub,  # noqa: F811
    llama_target: models.LoadedModel,
) -> None:
    """Catches a hub that commits the wrong nodes after a tree verdict (its tokens differ from
    the target's after the round), a target that keeps a rejected branch's keys, and EAGLE
    feature rows misaligned after a path that is not the first children. The trained toy
    EAGLE head accepts long paths; the random draft LLM some."""
    if kind == "eagle":
        hub, target, taps = trained_hub, models.load_causal_lm(models.TOY_TARGET_DIR), (-1,)
        text = ["To be, or not to be", "Now is the winter of our discontent", "O"]
        prompts = [models.encode_text(target, t) for t in text]
    else:
        hub, target, taps = llm_hub, llama_target, ()
        prompts = [[5, 17, 33, 8], [9, 4], [21, 22, 23, 24, 25]]
    backend = TorchBackend(target)
    lengths: list[int] = []
    for prompt in prompts:
        seq = TargetSequence(backend, prompt, SamplingParams(), 32, taps=taps)
        lengths += _tree_rounds(hub, seq, TreeShape(3, 4, 12))
        assert seq.generated == greedy_alone(target, prompt, 32), prompt
    assert sum(lengths) > len(lengths) // (1 if kind == "eagle" else 8), lengths


def test_sampling_through_tree_rounds_matches_the_target_distribution(
    llm_hub: hub_module.Hub, llama_target: models.LoadedModel
) -> None:
    """Chi-square on the first two tokens' joint law (top-k 20), 1500 trials of a tree of
    three children per node: catches q rows sent for the wrong node (a child's own instead of
    its parent's), siblings drawn with replacement, and a target that skips the residual
    after a rejected sibling."""
    trials, prompt = 1500, [5, 17, 33, 8]
    expected = _two_token_law(llama_target, prompt, SamplingParams(1.0, top_k=20))
    counts: dict[tuple[int, int], int] = {}
    backend = TorchBackend(llama_target)
    accepted = 0
    for trial in range(trials):
        seq = TargetSequence(backend, prompt, SamplingParams(1.0, 20, 1.0, trial), 2)
        accepted += sum(_tree_rounds(llm_hub, seq, TreeShape(3, 2, 6)))
        key = (seq.generated[0], seq.generated[1])
        counts[key] = counts.get(key, 0) + 1
    assert accepted > trials // 20, accepted  # drafts were accepted: the residuals were used
    assert set(counts) <= set(expected)
    assert law_pvalue(counts, expected, trials) > 1e-3


@pytest.mark.slow
def test_targets_through_a_tree_hub_over_the_wire_equal_the_target_alone(tmp_path: Path) -> None:
    """Real processes, the committed toy pair, a hub drafting trees every round (--tree on)
    at --gamma 1, two targets with two sequences each: catches trees lost or refused on the
    wire (the targets would fall back to decoding alone: output still right, but no more than
    one draft accepted per round, which is all a gamma-1 chain can give) and paths the hub
    refuses (a strike drops the session)."""
    from procs import ENV, REPO, HubProcess, read_jsonl, reference, target_cmd

    from scripts.bench.harness import write_prompts

    args = ("--tree", "on", "--gamma", "1", "--tree-width", "2", "--tree-depth", "4")
    hub = HubProcess(models.TOY_DRAFT_DIR, tmp_path / "hub.log", *args)
    words = ["To be, or not to be", "Now is the winter", "All the world", "O"]
    procs, outs = [], []
    for t in range(2):
        prompts = write_prompts(tmp_path / f"in{t}.jsonl", words[2 * t : 2 * t + 2])
        outs.append(tmp_path / f"out{t}.jsonl")
        cmd = target_cmd(hub.endpoint, models.TOY_TARGET_DIR, prompts, outs[-1])
        procs.append(subprocess.Popen([*cmd, "--concurrency", "2"], env=ENV, cwd=REPO))
    for proc in procs:
        assert proc.wait(timeout=180) == 0
    rounds = accepted = 0
    for t, out in enumerate(outs):
        for row, prompt in zip(read_jsonl(out), words[2 * t : 2 * t + 2], strict=True):
            expected = reference(models.TOY_TARGET_DIR, prompt, 24)
            assert_greedy(models.TOY_TARGET_DIR, prompt, row["token_ids"], expected)
            rounds += row["stats"]["rounds"]
            accepted += row["stats"]["accepted"]
    assert rounds > 0 and accepted > rounds, (rounds, accepted)  # paths longer than one node
    assert hub.stop() == 0
    assert "trees of 8 nodes" in hub.log_path.read_text()  # min(the hub's 8, the target's 32)
