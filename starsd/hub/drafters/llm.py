"""The draft-LLM proposer (``--draft-kind llm``): chain drafting with a separate small causal LM.

Each session keeps its own KV cache next to the committed tokens; a verdict crops the cache back
to what stays valid (the accepted prefix) before drafting again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from starsd import models
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
class LlmState(ChainState):
    """A session of the draft LLM: the shared chain state plus its KV cache."""

    cache: Any = None  # transformers DynamicCache over the committed (and drafted) positions


class LlmProposer:
    """Chain drafting with a small causal LM (q), one session at a time."""

    kind = "llm"
    feature_width = 0

    def __init__(self, draft: models.LoadedModel) -> None:
        self.draft = draft
        self.max_positions = draft.max_positions

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> LlmState:
        """A session's state with an empty cache; the prompt is fed with its first job."""
        chain = new_chain_state(prompt, params, gamma)
        return LlmState(**vars(chain), cache=models.new_cache(self.draft))

    def propose(self, jobs: list[DraftJob[LlmState]]) -> list[Proposal | Error]:
        """Apply each job's verdict and draft its next proposal (one result per job)."""
        return propose_each(jobs, self._draft)

    def _draft(self, job: DraftJob[LlmState]) -> Proposal | Error:
        state = job.state
        feed = apply_verdict(state, job.accepted, job.appended)
        gamma = fitting_gamma(state, self.max_positions)
        if gamma < 1:
            return context_full(job)
        logits = models.forward(self.draft, feed, state.cache)[-1]  # [V]
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        for i in range(gamma):
            token, q = draw(logits, state.params, state.generator)
            tokens.append(token)
            if q is not None:
                q_rows.append(q)
            if i < gamma - 1:
                logits = models.forward(self.draft, [token], state.cache)[-1]  # [V]
        state.proposed = tokens
        return make_proposal(job, tokens, q_rows, state.params)


def apply_verdict(state: LlmState, accepted: int, appended: tuple[int, ...]) -> list[int]:
    """Commit the verdict and crop the cache to what stays valid.

    Returns the tokens to feed next: those committed but not cached (at least the last one,
    whose logits give the first draft token).
    """
    valid = min(models.cache_length(state.cache), len(state.tokens) + accepted)
    commit_verdict(state, accepted, appended)
    valid = min(valid, len(state.tokens) - 1)
    models.crop_cache(state.cache, valid)
    return state.tokens[valid:]
