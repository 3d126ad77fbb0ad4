"""``--gamma auto`` on the drafting thread: learn from each job, plan its round, record the batch.

:class:`Pacer` is the drafting engine's collaborator for draft length; the rule itself is
:class:`~starsd.hub.policy.GammaPolicy` (pure). For every batch the engine asks, in order:

1. :meth:`Pacer.load` - what the batch being formed looks like to the policy: its size, the hub's
   regime (:class:`~starsd.hub.policy.LoadMeter`), the fitted S(B, g)
   (:class:`~starsd.hub.estimates.ServiceModel`), the hub's common gamma and T_alone;
2. :meth:`Pacer.plan` per job - learn from the verdict it carries (acceptance per position, the
   round trip outside the hub R(g), after a span alone T_alone, the queue wait W), then choose
   this round: a :class:`Plan` of gamma draft tokens (set on the session's draft state) or a
   span alone. A span's verdict is held on the session's pacing and merged into its next
   drafted job (:meth:`Pacer.with_held`), so proposers never see a gamma of 0;
3. :meth:`Pacer.drafted` - the batch's (size, longest proposal, seconds), for S(B, g);
4. :meth:`Pacer.sent` per job - when its proposal left, and what it held.

A session's :class:`~starsd.hub.policy.SessionPacing` lives on its draft state
(``ChainState.pacing``), created on its first job here; like the rest of that state it belongs to
the drafting thread, so nothing here takes the hub lock. Nothing here changes what is proposed
for a given gamma, nor the verdict a proposer applies, so losslessness is the proposers' and the
target's as before.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from starsd import limits
from starsd.hub.drafters.base import DraftJob
from starsd.hub.estimates import ServiceModel
from starsd.hub.policy import (
    CommonGamma,
    GammaPolicy,
    Load,
    LoadMeter,
    OwnerMemory,
    Pending,
    SessionPacing,
)
from starsd.hub.shapes import CHAIN, ShapeChooser, trees_worth_trying
from starsd.tree_shapes import TreeShape

log = logging.getLogger("starsd.hub")

_WAIT_SMOOTHING = 0.2  # W: weight of the newest queue wait
_ALONE_SMOOTHING = 0.3  # T_alone: weight of the newest span
_HUB_ALONE_SMOOTHING = 0.1  # the hub's T_alone, over every session's spans


@dataclass(frozen=True)
class TreePlan:
    """``--tree`` auto or on, with the tree shapes it drafts (node budgets capped per target):
    under on the first (the configured one), under auto the rule's pick of them."""

    mode: str  # "auto" (the rule of starsd.hub.shapes) or "on" (always, where verified)
    shapes: tuple[TreeShape, ...]  # starsd.tree_shapes.tree_ladder, the largest first


@dataclass(frozen=True)
class Plan:
    """One job's round: ``gamma`` draft tokens (>= 1), or ``alone`` tokens decoded by the target
    itself (gamma 0); exactly one of them is 0. ``held``: a verdict is held since a span alone
    (this round drafts it, merged; no pre-drafted branch can answer it)."""

    gamma: int
    alone: int = 0
    held: bool = False


class Pacer:
    """Draft length per session per round (see the module docstring). Drafting thread only."""

    def __init__(
        self,
        policy: GammaPolicy,
        max_positions: int | None,
        clock: Callable[[], float] = time.perf_counter,
        trees: TreePlan | None = None,
    ) -> None:
        self.policy = policy
        self.trees = trees  # None: chains only (--tree off, or a proposer without trees)
        self.max_positions = max_positions  # the draft's context: a span must leave room
        self.clock = clock  # the clock DraftJob.enqueued_at is read on
        self.service = ServiceModel()
        self.meter = LoadMeter(policy.params.loaded_busy)
        self.owners = OwnerMemory()  # each target's shared pacing (its auto sessions')
        self.common = CommonGamma(policy.params.max_gamma)  # what the auto sessions draft
        # --tree auto: a chain or one of the plan's trees, for every session at once
        self.shapes = ShapeChooser(1 + (len(trees.shapes) if trees is not None else 0))
        self.alone_s: float | None = None  # T_alone over the hub's sessions (smoothed)

    # ------------------------------------------------------------------ the engine's calls

    def load(self, batch: int, backlog: bool, now: float) -> Load | None:
        """The batch of ``batch`` jobs starts at ``now`` (``backlog``: jobs were left queued);
        None until a batch has been timed (the policy then keeps the starting gamma)."""
        loaded = self.meter.start(now, backlog)
        costs = self.service.costs(batch, self.policy.params.max_gamma)
        if costs is None:
            return None
        return Load(batch, loaded, costs, self.common.mode(), self.alone_s)

    def plan(self, job: DraftJob, load: Load | None, now: float) -> Plan:
        """Learn from ``job``, then this round's plan. A job whose target took a pushed branch
        has its round decided already (the branch's length): it is learnt from only."""
        pacing = self.pacing_of(job)
        self._learn(job, pacing, now)
        if job.taken:
            job.state.tree = None  # a pushed branch is a chain
            pacing.beside_trees = _trees_beside(pacing)
            return Plan(job.taken)
        held = pacing.pending is not None  # after a span alone this round is the probe
        before = pacing.chosen
        gamma = self.policy.next_round(pacing, load, probe=held)
        if gamma != before and log.isEnabledFor(logging.DEBUG):
            log.debug("session %s: gamma %d -> %d", job.tag.hex()[:8], before, gamma)
        if pacing.fixed is None:
            self.common.vote(pacing.vote)
        span = self._span(job, pacing) if gamma == 0 else 0
        if span:
            if pacing.pending is None:
                pacing.pending = _pending(job)
            return Plan(0, span, held=True)
        job.state.gamma = max(gamma, 1)
        option, phase = self._shape(job, pacing, load, now)
        job.state.tree = self._tree(option, job.tree_nodes)
        pacing.shape, pacing.asked_at = option, job.enqueued_at
        pacing.beside_trees = option == CHAIN and _trees_beside(pacing)
        pacing.shape_phases = (phase, pacing.shape_phases[0])
        return Plan(job.state.gamma, held=held)

    def _shape(
        self, job: DraftJob, pacing: SessionPacing, load: Load | None, now: float
    ) -> tuple[int, int]:
        """This round's option (CHAIN, or the plan's k-th tree shape) and its phase of the
        hub's :class:`~starsd.hub.shapes.ShapeChooser` (-1: none): never a tree to a target
        that does not verify them, nor for a pushed branch's round, nor under auto to a session
        with a fixed gamma; under on the largest tree; otherwise the chooser's, where this
        session's figures say it is worth trying (else its chain, outside the phase)."""
        plan = self.trees
        if plan is None or job.tree_nodes < 1 or job.taken:
            return CHAIN, -1
        if plan.mode == "on":
            return 1, -1
        # a session whose target fixed its gamma drafts chains of it (its sampled output is then
        # reproducible round for round, which a shape chosen by timing would not be); the
        # others chains until the gamma's figures are in
        if pacing.fixed is not None or not self.policy.settled(pacing):
            return CHAIN, -1
        worth = self._trees_worth(pacing, load, job.tree_nodes)
        option, phase = self.shapes.use_shape(load is not None and load.loaded, now, worth)
        return (option, phase) if worth is None or option in worth else (CHAIN, -1)

    def _trees_worth(
        self, pacing: SessionPacing, load: Load | None, nodes: int
    ) -> frozenset[int] | None:
        """The options this session's figures say are worth trying (shapes.trees_worth_trying,
        its trees capped at the target's ``nodes``); None before the hub's costs are timed.
        Once per target and phase (its sessions share the figures, which a phase barely
        moves; ~25 us a call, every job of an auto session otherwise)."""
        if load is None or self.trees is None:
            return None
        shared, key = pacing.shared, (self.shapes.phase, nodes)
        if shared.shapes_worth is not None and shared.shapes_worth[0] == key:
            return shared.shapes_worth[1]
        trees = [dataclasses.replace(t, nodes=min(t.nodes, nodes)) for t in self.trees.shapes]
        expected = pacing.estimate.expected_tokens()
        rounds = shared.round_trips(max([pacing.chosen, *(t.nodes for t in trees)]))
        outside = functools.partial(_round_trip, pacing.wait, rounds)
        worth = trees_worth_trying(expected, pacing.chosen, trees, load.costs, outside)
        shared.shapes_worth = (key, worth)
        return worth

    def _tree(self, option: int, nodes: int) -> TreeShape | None:
        """Option ``option``'s tree, its nodes capped at the target's ``nodes``; None: a chain."""
        if option == CHAIN or self.trees is None:
            return None
        shape = self.trees.shapes[option - 1]
        return dataclasses.replace(shape, nodes=min(shape.nodes, nodes))

    def with_held(self, job: DraftJob) -> DraftJob:
        """``job`` with the verdict held since a span alone in its place (that verdict, then
        every token committed since, as if the target had sent them in one DRAFT)."""
        pacing = job.state.pacing
        held = pacing.pending if pacing is not None else None
        if held is None:
            return job
        pacing.pending = None
        features = None
        if held.features:
            features = (
                held.features[0] if len(held.features) == 1 else np.concatenate(held.features)
            )
        return dataclasses.replace(
            job, accepted=held.accepted, appended=tuple(held.appended), features=features
        )

    def drafted(self, batch: int, longest: int, seconds: float) -> None:
        """A drafted batch: ``batch`` jobs, the longest proposal ``longest`` tokens."""
        self.service.observe(batch, longest, seconds)

    def finished(self, now: float, seconds: float) -> None:
        """The batch that :meth:`load` started took ``seconds`` and ended at ``now``."""
        self.meter.finish(now, seconds)

    def sent(self, job: DraftJob, now: float) -> None:
        """``job``'s answer left at ``now``: its next verdict's round trip starts here."""
        if job.state.pacing is not None:
            job.state.pacing.sent_at = now

    # ------------------------------------------------------------------ sessions

    def pacing_of(self, job: DraftJob) -> SessionPacing:
        """The session's pacing, made on its first job: a fixed one keeps its gamma; an auto
        one shares its target's figures (:class:`~starsd.hub.policy.TargetPacing`) with the
        target's other auto sessions, made with the target's first."""
        state = job.state
        if state.pacing is None:
            if not job.auto:
                state.pacing = self.policy.new_session(state.gamma)
            else:
                shared = self.owners.get(job.owner)
                state.pacing = self.policy.new_session(None, start=state.gamma, like=shared)
                self.owners.put(job.owner, state.pacing.shared)
        return state.pacing

    def _learn(self, job: DraftJob, pacing: SessionPacing, now: float) -> None:
        """Update the session's estimates from ``job``; after a span alone, add the span's
        tokens (and feature rows) to the verdict held since then."""
        pacing.wait += _WAIT_SMOOTHING * (max(now - job.enqueued_at, 0.0) - pacing.wait)
        # The round trip and the span alone without the target's forwards that did not carry
        # this sequence (Draft.others_us). Other sequences' prefills: a stream's new requests
        # stall every round they overlap, alone or drafting alike, but only the round trips are
        # timed often (a span alone rarely), so the stalls made speculating look slower than
        # decoding alone: one target at --concurrency 8 decoded half its tokens alone where
        # gamma 1 and 2 paid. Rows out of step (a new session's first rounds, the others' span
        # alone): R predicts a round while the target's sessions draft together, one forward a
        # round; a round that waited out a forward of other rows read 250-320 ms for 160, the
        # time outside the forward kept it for dozens of rounds, and the sessions went alone.
        since = None if pacing.sent_at is None else job.enqueued_at - pacing.sent_at - job.others_s
        held = pacing.pending
        if held is not None:  # the DRAFT after a span alone: accepted 0, the span's tokens
            # (for a --gamma 0 session, one of several spans since it last drafted)
            held.appended.extend(job.appended)
            if job.features is not None:
                held.features.append(job.features)
            if since is not None and since > 0 and job.appended:
                self._timed_alone(pacing, since / len(job.appended))
            if job.forward_s > 0:  # its steps: a forward of no draft tokens
                pacing.shared.observe_forward(0, job.forward_s)
            return
        # A verify commits exactly one token after the accepted ones: anything else means the
        # target decoded alone meanwhile (its deadline passed), which says nothing about either.
        if job.proposed >= 1 and len(job.appended) == 1 and pacing.asked_at is not None:
            # the whole round, asked to answered (others' forwards left out, as above)
            seconds = job.enqueued_at - pacing.asked_at - job.others_s
            self.shapes.observe(pacing.shape, pacing.shape_phases, job.accepted + 1, seconds)
        if pacing.shape != CHAIN:  # a tree's path is no chain's acceptance per position
            return
        if pacing.fixed is None and job.proposed >= 1 and len(job.appended) == 1:
            pacing.estimate.observe(job.proposed, min(job.accepted, job.proposed))
            # At a target with other sessions open a probe's round trip is left out of R(g): R
            # predicts a round while the target's sessions all draft, and a probe's
            # verification rides in a forward of the others' steps at a fraction of that (one
            # target at --concurrency 4: the probes' R(1) made drafting look 15% ahead, every
            # session switched, and each switch back cost). Alone, a probe is a plain round.
            # A chain drafted while other sessions of its target had trees in flight is left
            # out too: a target verifying it beside their nodes (a CPU's forward of 8 rows
            # grew ~12 ms a node) priced every chain at the trees' cost, and the target's
            # sessions went alone.
            if pacing.beside_trees:
                return
            probe_in_batch = pacing.probing and pacing.shared.batched(pacing)
            if since is not None and since > 0 and not probe_in_batch:
                pacing.shared.observe_round(job.proposed, since, job.forward_s)
            if job.forward_s > 0:
                pacing.shared.observe_forward(job.proposed, job.forward_s)

    def _timed_alone(self, pacing: SessionPacing, step: float) -> None:
        old = pacing.alone_step
        pacing.alone_step = step if old is None else old + _ALONE_SMOOTHING * (step - old)
        hub = self.alone_s
        self.alone_s = step if hub is None else hub + _HUB_ALONE_SMOOTHING * (step - hub)

    def _span(self, job: DraftJob, pacing: SessionPacing) -> int:
        """Tokens the session decodes alone now: its span, so that the DRAFT after it still
        fits the draft's context and one message; 0 when not even one fits (draft instead)."""
        span = min(pacing.alone_span, limits.MAX_APPENDED - 1)
        if self.max_positions is not None:
            held = pacing.pending
            accepted, appended = (
                (held.accepted, held.appended) if held is not None else (job.accepted, job.appended)
            )
            committed = len(job.state.tokens) + accepted + len(appended)
            span = min(span, self.max_positions - committed - 1)
        return max(span, 0)


def _pending(job: DraftJob) -> Pending:
    """The verdict ``job`` carries, held until the session drafts again."""
    features = [] if job.features is None else [job.features]
    return Pending(job.accepted, list(job.appended), features)


def _trees_beside(pacing: SessionPacing) -> bool:
    """Whether another session of ``pacing``'s target has a tree in flight: the target may
    verify this session's chain beside its nodes. Its own target's, not the hub's tree phase:
    a hub whose last settled sessions left in a tree phase counted every later target's warm-up
    chains as beside trees, so they never fed R, the target never settled, and the phase,
    which only settled sessions advance, never ended (auto froze at its start gamma)."""
    return any(other.shape != CHAIN for other in pacing.shared.sessions if other is not pacing)


def _round_trip(wait: float, rounds: list[float], x: int) -> float:
    """W + R(x) outside the hub, with x tokens or nodes to verify (``rounds``: R(0..))."""
    return wait + rounds[x]
