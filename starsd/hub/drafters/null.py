"""The null proposer (``--draft-kind null``): no model work, for measuring the hub's own overhead.

It proposes the last committed token gamma times, so every round exercises the whole protocol
path (decode, queue, drafting thread, delivery, send) with a draft step that costs nothing.
"""

from __future__ import annotations

from starsd.hub.drafters.base import (
    ChainState,
    DraftJob,
    commit_verdict,
    make_proposal,
    new_chain_state,
    propose_each,
)
from starsd.protocol import Error, ErrorCode, Proposal, SamplingParams


class NullProposer:
    """Proposes the last token gamma times; greedy sessions only."""

    kind = "null"
    feature_width = 0
    feature_layers: tuple[int, ...] = ()
    max_positions: int | None = None
    trees = False  # chains only

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> ChainState:
        """Just the committed tokens; there is no model to prime."""
        return new_chain_state(prompt, params, gamma)

    def propose(self, jobs: list[DraftJob[ChainState]]) -> list[Proposal | Error]:
        """One proposal per job, without model work."""
        return propose_each(jobs, self._draft)

    def _draft(self, job: DraftJob[ChainState]) -> Proposal | Error:
        state = job.state
        if not state.params.greedy:
            return Error(
                ErrorCode.INVALID_ARGUMENT,
                "the null drafter is greedy only",
                tag=job.tag,
                seq=job.seq,
            )
        commit_verdict(state, job.accepted, job.appended, job.path)
        return self._proposal(job)

    def _proposal(self, job: DraftJob[ChainState]) -> Proposal:
        """The last committed token gamma times."""
        state = job.state
        state.proposed = [state.tokens[-1]] * state.gamma
        return make_proposal(job, state.proposed, [], state.params)
