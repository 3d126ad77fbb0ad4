"""What every proposer shares: the ``Proposer`` protocol, a draft job, chain state and its helpers.

A proposer turns draft jobs into proposals on the hub's drafting thread, and only there. Each
kind (``llm``, ``eagle``, ``null``) lives in its own module with its own state type; the state of
a session is created by ``new_state`` on the event loop (no model work) and from then on touched
only by the drafting thread.

Terms (as in the target's rejection sampler): after a proposal of gamma draft tokens the target
sends a verdict, ``accepted`` (how many draft tokens it kept) and ``appended`` (the tokens it
committed after them: the recovered or bonus token, plus any it decoded alone meanwhile).
:func:`commit_verdict` is the one place that applies a verdict to the committed tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from starsd import sampling
from starsd.protocol import Error, ErrorCode, Proposal, SamplingParams

log = logging.getLogger("starsd.hub.drafters")


@dataclass
class ChainState:
    """Draft-side state every chain proposer keeps for one session."""

    tokens: list[int]  # committed by the target: prompt + generated
    params: SamplingParams
    gamma: int
    generator: torch.Generator  # the session's own draws, whoever else is drafted
    proposed: list[int] = field(default_factory=list)  # the last proposal's draft tokens


S = TypeVar("S", bound=ChainState)


@dataclass(frozen=True)
class DraftJob(Generic[S]):
    """A request for proposal ``seq`` after applying the verdict (accepted, appended)."""

    tag: bytes
    seq: int
    state: S
    accepted: int
    appended: tuple[int, ...]
    enqueued_at: float = field(default_factory=time.perf_counter)
    features: np.ndarray | None = None  # EAGLE: [n, H] target features that came with it


class Proposer(Protocol[S]):
    """One drafting kind: makes per-session state and drafts proposals for jobs."""

    kind: str  # the --draft-kind name, announced in WELCOME
    feature_width: int  # > 0: drafts from target features, which OPEN and DRAFT must carry
    max_positions: int | None  # the draft's context limit, None when unbounded

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> S:
        """State for a new session; nothing is computed until its first job."""
        ...

    def propose(self, jobs: list[DraftJob[S]]) -> list[Proposal | Error]:
        """Apply each job's verdict and draft its next proposal: one result per job, in order."""
        ...


def new_chain_state(prompt: list[int], params: SamplingParams, gamma: int) -> ChainState:
    """The shared part of a session's state: committed tokens and its own generator."""
    generator = sampling.make_generator(params.seed)
    return ChainState(tokens=list(prompt), params=params, gamma=gamma, generator=generator)


def commit_verdict(state: ChainState, accepted: int, appended: tuple[int, ...]) -> None:
    """Commit the first ``accepted`` proposed tokens, then ``appended``; forget the proposal."""
    state.tokens.extend(state.proposed[:accepted])
    state.tokens.extend(appended)
    state.proposed = []


def fitting_gamma(state: ChainState, max_positions: int | None) -> int:
    """The session's gamma, shortened so the draft never runs past its context limit."""
    if max_positions is None:
        return state.gamma
    return min(state.gamma, max_positions - len(state.tokens))


def propose_each(
    jobs: list[DraftJob[S]], draft_one: Callable[[DraftJob[S]], Proposal | Error]
) -> list[Proposal | Error]:
    """Draft jobs one after another; a failing session costs its own job an INTERNAL error."""
    results: list[Proposal | Error] = []
    for job in jobs:
        try:
            results.append(draft_one(job))
        except Exception as exc:  # one bad session must not take the drafting thread down
            log.exception("drafting failed for session %s", job.tag.hex()[:8])
            results.append(_job_error(job, ErrorCode.INTERNAL, f"drafting failed: {exc}"))
    return results


def context_full(job: DraftJob[S]) -> Error:
    """The reply when the draft has no room left for even one token."""
    return _job_error(job, ErrorCode.CONTEXT_FULL, "draft context is full")


def _job_error(job: DraftJob[S], code: str, message: str) -> Error:
    return Error(code, message, tag=job.tag, seq=job.seq)


def draw(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    """One draft token from ``logits`` [V]; with sampling also q, its distribution [V]."""
    if params.greedy:
        return int(torch.argmax(logits)), None
    q = sampling.probs_from_logits(logits, params)  # [V]
    return int(sampling.sample(q[None], gen)[0]), q


def make_proposal(
    job: DraftJob[S], tokens: list[int], q_rows: list[torch.Tensor], params: SamplingParams
) -> Proposal:
    """The wire proposal: tokens, and q as none (greedy), sparse (top-k/top-p) or dense."""
    token_arr = np.asarray(tokens, dtype=np.int32)  # [gamma]
    if params.greedy or not tokens:
        return Proposal(tag=job.tag, seq=job.seq, tokens=token_arr)
    q = torch.stack(q_rows)  # [gamma, V]
    if params.truncated:
        support, probs = sampling.sparse_q(q)  # [gamma, K] each
        return Proposal(job.tag, job.seq, token_arr, probs.numpy(), support.numpy())
    return Proposal(job.tag, job.seq, token_arr, q.numpy().astype(np.float32))
