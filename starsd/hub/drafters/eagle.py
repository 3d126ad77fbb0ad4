"""The EAGLE proposer (``--draft-kind eagle``): chain drafting from the target's own features.

Per session the hub keeps the committed tokens and the head's KV cache. The cache's first
``real_pairs`` positions hold pairs (f_j, x_{j+1}) fed with the target's features f_j (sent with
OPEN and every DRAFT); the positions after them hold the head's own chained guesses and are cut
before the next verdict is applied. The head's output at the last real pair is its prediction of
the feature of the last committed token, whose draft logits give the first draft token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from starsd import eagle
from starsd.hub.drafters.base import (
    ChainState,
    DraftJob,
    commit_verdict,
    context_full,
    draw,
    fitting_gamma,
    make_proposal,
    new_chain_state,
    propose_each,
)
from starsd.protocol import Error, Proposal, SamplingParams


@dataclass
class EagleState(ChainState):
    """A session of the EAGLE head: the chain state, the head's cache and its last prediction."""

    cache: Any = None  # the head's KV cache: real pairs first, then chained guesses
    real_pairs: int = 0  # leading cache positions fed with the target's own features
    last_feature: torch.Tensor | None = None  # [H] the head's prediction at the last real pair


class EagleProposer:
    """Drafts with an EAGLE-1 head on the target's embedding and LM head."""

    kind = "eagle"

    def __init__(self, head: eagle.LoadedEagle, max_positions: int | None) -> None:
        self.head = head
        self.max_positions = max_positions
        self.feature_width = head.config.hidden_size

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> EagleState:
        """A session's state; the prompt's features come with its first job."""
        chain = new_chain_state(prompt, params, gamma)
        return EagleState(**vars(chain), cache=self.head.new_cache())

    def propose(self, jobs: list[DraftJob[EagleState]]) -> list[Proposal | Error]:
        """Apply each job's verdict and features, then draft its next proposal."""
        return propose_each(jobs, self._draft)

    def _draft(self, job: DraftJob[EagleState]) -> Proposal | Error:
        state = job.state
        commit_verdict(state, job.accepted, job.appended)
        state.cache.crop(state.real_pairs)
        feature = self._feed(state, job)  # [H] predicted feature of the last token, or None
        gamma = fitting_gamma(state, self.max_positions)
        if gamma < 1:
            return context_full(job)
        if feature is None:  # a one-token prompt: nothing to extrapolate from yet
            return make_proposal(job, [], [], state.params)
        tokens, q_rows = self._chain(state, feature, gamma)
        state.proposed = tokens
        return make_proposal(job, tokens, q_rows, state.params)

    def _feed(self, state: EagleState, job: DraftJob[EagleState]) -> torch.Tensor | None:
        """Feed the new real pairs; the head's prediction at the last one."""
        n = 0 if job.features is None else len(job.features)
        if n == 0:
            return None if state.real_pairs == 0 else state.last_feature
        start = state.real_pairs
        ids = state.tokens[start + 1 : start + 1 + n]  # x_{j+1} for each new f_j
        assert job.features is not None
        out = self.head.forward(ids, torch.from_numpy(job.features), state.cache)  # [n, H]
        state.real_pairs += n
        state.last_feature = out[-1]
        return out[-1]

    def _chain(
        self, state: EagleState, feature: torch.Tensor, gamma: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        for i in range(gamma):
            logits = self.head.logits(feature[None])[0]  # [V]
            token, q = draw(logits, state.params, state.generator)
            tokens.append(token)
            if q is not None:
                q_rows.append(q)
            if i < gamma - 1:
                feature = self.head.forward([token], feature[None], state.cache)[-1]  # [H]
        return tokens, q_rows
