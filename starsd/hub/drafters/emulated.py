"""The emulated proposer (``--draft-kind emulated --draft-profile D.json``): a drafter that
costs what a profiled one costs, without its model.

It drafts as the null proposer does (the last committed token gamma times; greedy only) and then
sleeps until the batch has taken what a draft profile (``starsd profile draft``, or a published
one) says it costs: the hub's batching, queueing, gamma and tree policies then run against
another machine's drafting costs (replaying a GPU hub's profile on a CPU). The sleep happens in
the drafting thread, as a model's forward would.

Token trees too (``--tree``): every tree of one shape has the same topology,
:func:`starsd.tree_shapes.ranked_tree`: the tree a draft grows (EAGLE-2's growth and pruning, as
:mod:`~starsd.hub.drafters.tree_draft` does it) when its k-th choice at every node holds
:data:`~starsd.tree_shapes.CHOICE_WEIGHT` ** (k - 1) of its first choice's probability; a node's
k-th listed child is its k-th choice and carries token k - 1 (siblings differ, as a target
checks). Chain rows and tree rows of a batch are costed as the real proposers draft them, in
separate forwards: S(B_chains, g) plus, per tree shape, a(B) + (depth - 1) b(B * width)
(:meth:`starsd.service.ServiceCurve.tree_at`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from starsd.hub.drafters.base import ChainState, DraftJob, make_proposal
from starsd.hub.drafters.null import NullProposer
from starsd.plan import service_curve
from starsd.profile import load_profile
from starsd.protocol import Error, Proposal
from starsd.service import ServiceCurve
from starsd.tree_shapes import TreeShape, ranked_tree


class EmulatedProposer(NullProposer):
    """Null drafting (chains and trees), paced to a service curve S(B, g)."""

    kind = "emulated"
    trees = True

    def __init__(self, curve: ServiceCurve) -> None:
        self.curve = curve

    @classmethod
    def from_profile(cls, path: str) -> EmulatedProposer:
        """From a draft profile (ProfileError if it is not a usable one)."""
        return cls(service_curve(load_profile(path, "draft")))

    def propose(self, jobs: list[DraftJob[ChainState]]) -> list[Proposal | Error]:
        """Null proposals, returned once the batch's drafting time (:meth:`cost`) has passed."""
        _refuse_event_loop()
        began = time.perf_counter()
        results = super().propose(jobs)
        drafted = [
            job.state
            for job, r in zip(jobs, results, strict=True)
            if isinstance(r, Proposal) and len(r.tokens)
        ]
        wait = self.cost(drafted) - (time.perf_counter() - began)
        if wait > 0:
            time.sleep(wait)  # the forward it stands for blocks its thread too, taking no CPU
        return results

    def cost(self, drafted: list[ChainState]) -> float:
        """Seconds a batch of these sessions' proposals costs: the chain rows' forwards, then
        each tree shape's (the real proposers draft them apart, ``base.by_shape``)."""
        chains = [len(s.proposed) for s in drafted if s.tree is None]
        seconds = self.curve.at(len(chains), max(chains)) if chains else 0.0
        shapes: dict[TreeShape, int] = {}
        for state in drafted:
            if state.tree is not None:
                shapes[state.tree] = shapes.get(state.tree, 0) + 1
        for shape, rows in shapes.items():
            seconds += self.curve.tree_at(rows, shape.width, shape.depth)
        return seconds

    def _proposal(self, job: DraftJob[ChainState]) -> Proposal:
        """The null chain, or the round's tree (:func:`~starsd.tree_shapes.ranked_tree`)."""
        state = job.state
        if state.tree is None:
            return super()._proposal(job)
        tokens, parents = ranked_tree(state.tree)
        state.proposed, state.proposed_parents = list(tokens), list(parents)
        proposal = make_proposal(job, state.proposed, [], state.params)
        return dataclasses.replace(proposal, parents=np.asarray(parents, dtype=np.int32))


def _refuse_event_loop() -> None:
    """The sleep blocks its thread, like the forward it emulates: it belongs in the hub's
    drafting thread, and on an event loop it would stall every target's messages, so a call
    from one is a bug."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("EmulatedProposer.propose blocks: call it from a worker thread")
