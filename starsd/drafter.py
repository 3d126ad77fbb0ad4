"""The hub's drafter: per-session draft state (q side) and ``propose(jobs) -> results``.

Runs only on the hub's drafting thread. Each session keeps its own KV cache and the tokens the
target has committed; a verdict rolls the cache back to the accepted prefix before drafting again.
The interface takes a batch of jobs so batched drafting can replace the loop without a redesign.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from starsd import models, sampling
from starsd.protocol import Error, ErrorCode, Proposal, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class DraftState:
    """Draft-side state of one session; touched only by the drafting thread."""

    tokens: list[int]  # committed by the target: prompt + generated
    params: SamplingParams
    gamma: int
    generator: torch.Generator
    cache: Any
    proposed: list[int] = field(default_factory=list)  # the last proposal's draft tokens
    real_pairs: int = 0  # EAGLE: leading cache positions fed with the target's own features
    last_feature: Any = None  # EAGLE: [H] the head's prediction at the last real pair


@dataclass(frozen=True)
class DraftJob:
    """A request for proposal ``seq`` after applying the verdict (accepted, appended)."""

    tag: bytes
    seq: int
    state: DraftState
    accepted: int
    appended: tuple[int, ...]
    enqueued_at: float = field(default_factory=time.perf_counter)
    features: np.ndarray | None = None  # EAGLE: [n, H] target features that came with it


class Drafter:
    """Chain drafting with a separate small causal LM (``--draft-kind llm``)."""

    kind = "llm"
    feature_width = 0  # > 0: drafts from target features, which OPEN and DRAFT must carry
    # Jobs one propose() call drafts together. Chain drafting loops over its jobs, so the hub
    # hands it one at a time and each proposal leaves as soon as it is drafted; a batch would
    # hold its first proposal back until its last was drafted.
    batch_size = 1

    def __init__(self, draft: models.LoadedModel) -> None:
        self.draft = draft
        self.max_positions = draft.max_positions

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> DraftState:
        """Draft state for a new session; nothing is computed until its first job."""
        return DraftState(
            tokens=list(prompt),
            params=params,
            gamma=gamma,
            generator=sampling.make_generator(params.seed),
            cache=models.new_cache(self.draft),
        )

    def propose(self, jobs: list[DraftJob]) -> list[Proposal | Error]:
        """Apply each job's verdict and draft its next proposal (one result per job)."""
        return [self._propose_one(job) for job in jobs]

    def _propose_one(self, job: DraftJob) -> Proposal | Error:
        try:
            return self._draft(job)
        except Exception as exc:  # one bad session must not take the drafting thread down
            log.exception("drafting failed for session %s", job.tag.hex()[:8])
            return Error(ErrorCode.INTERNAL, f"drafting failed: {exc}", tag=job.tag, seq=job.seq)

    def _draft(self, job: DraftJob) -> Proposal | Error:
        state = job.state
        feed = apply_verdict(state, job.accepted, job.appended)
        gamma = self._fitting_gamma(state)
        if gamma < 1:
            return Error(ErrorCode.CONTEXT_FULL, "draft context is full", tag=job.tag, seq=job.seq)
        logits = models.forward(self.draft, feed, state.cache)[-1]  # [V]
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        for i in range(gamma):
            token, q = draw(logits, state.params, state.generator)
            tokens.append(token)
            if q is not None:
                q_rows.append(q)
            if i < gamma - 1:
                logits = models.forward(self.draft, [token], state.cache)[-1]
        state.proposed = tokens
        return make_proposal(job, tokens, q_rows, state.params)

    def _fitting_gamma(self, state: DraftState) -> int:
        limit = self.max_positions
        if limit is None:
            return state.gamma
        return min(state.gamma, limit - len(state.tokens))


class NullDrafter(Drafter):
    """Proposes the last token gamma times, with no model work: for measuring hub overhead."""

    kind = "null"

    def _draft(self, job: DraftJob) -> Proposal | Error:
        state = job.state
        if not state.params.greedy:
            return Error(ErrorCode.INVALID_ARGUMENT, "the null drafter is greedy only",
                         tag=job.tag, seq=job.seq)  # fmt: skip
        state.tokens.extend(state.proposed[: job.accepted])
        state.tokens.extend(job.appended)
        state.proposed = [state.tokens[-1]] * state.gamma
        return make_proposal(job, state.proposed, [], state.params)


DRAFTERS: dict[str, type[Drafter]] = {"llm": Drafter, "null": NullDrafter}


def apply_verdict(state: DraftState, accepted: int, appended: tuple[int, ...]) -> list[int]:
    """Commit ``accepted`` proposed tokens plus ``appended``; crop the cache to what stays valid.

    Returns the tokens to feed next: those committed but not cached (at least the last one,
    whose logits give the first draft token).
    """
    valid = min(models.cache_length(state.cache), len(state.tokens) + accepted)
    state.tokens.extend(state.proposed[:accepted])
    state.tokens.extend(appended)
    state.proposed = []
    valid = min(valid, len(state.tokens) - 1)
    models.crop_cache(state.cache, valid)
    return state.tokens[valid:]


def draw(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    if params.greedy:
        return int(torch.argmax(logits)), None
    q = sampling.probs_from_logits(logits, params)  # [V]
    return int(sampling.sample(q[None], gen)[0]), q


def make_proposal(
    job: DraftJob, tokens: list[int], q_rows: list[torch.Tensor], params: SamplingParams
) -> Proposal:
    token_arr = np.asarray(tokens, dtype=np.int32)  # [gamma]
    if params.greedy or not tokens:
        return Proposal(tag=job.tag, seq=job.seq, tokens=token_arr)
    q = torch.stack(q_rows)  # [gamma, V]
    if params.truncated:
        support, probs = sampling.sparse_q(q)  # [gamma, K] each
        return Proposal(job.tag, job.seq, token_arr, probs.numpy(), support.numpy())
    return Proposal(job.tag, job.seq, token_arr, q.numpy().astype(np.float32))
