"""The emulated proposer (``--draft-kind emulated --draft-profile D.json``): a drafter that
costs what a profiled one costs, without its model.

It drafts as the null proposer does (the last committed token gamma times; greedy only) and then
sleeps until the batch has taken S(B, g) from a draft profile (``starsd profile draft``, or a
published one), B the jobs in the call and g its longest proposal: the hub's batching, queueing
and gamma policy then run against another machine's drafting costs (replaying a GPU hub's
profile on a CPU). The sleep happens in the drafting thread, as a model's forward would.
"""

from __future__ import annotations

import time

from starsd.hub.drafters.base import ChainState, DraftJob
from starsd.hub.drafters.null import NullProposer
from starsd.plan import service_curve
from starsd.profile import load_profile
from starsd.protocol import Error, Proposal
from starsd.service import ServiceCurve


class EmulatedProposer(NullProposer):
    """Null drafting, paced to a service curve S(B, g)."""

    kind = "emulated"

    def __init__(self, curve: ServiceCurve) -> None:
        self.curve = curve

    @classmethod
    def from_profile(cls, path: str) -> EmulatedProposer:
        """From a draft profile (ProfileError if it is not a usable one)."""
        return cls(service_curve(load_profile(path, "draft")))

    def propose(self, jobs: list[DraftJob[ChainState]]) -> list[Proposal | Error]:
        """Null proposals, returned once S(len(jobs), longest proposal) has passed."""
        began = time.perf_counter()
        results = super().propose(jobs)
        gamma = max((len(r.tokens) for r in results if isinstance(r, Proposal)), default=0)
        if gamma:
            wait = self.curve.at(len(jobs), gamma) - (time.perf_counter() - began)
            if wait > 0:
                time.sleep(wait)
        return results
