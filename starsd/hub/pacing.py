"""The drafting thread's side of ``--gamma auto``: a proposer wrapper that sets each job's gamma.

:class:`PacedProposer` stands between the drafting engine and the real proposer. For every batch
the engine hands it, on the drafting thread and just before drafting, it

1. finds each job's session and its :class:`~starsd.hub.policy.SessionPacing` (one lock hold
   per batch; the pacing object is created there on a session's first job, stored on the
   table's ``Session.pacing``, and from then on touched by this thread only);
2. learns from the job: the verdict it carries updates the acceptance estimate, the time since
   the last proposal left updates R(g) (or T_alone after a span alone), the time it queued W;
3. chooses this round's gamma with :class:`~starsd.hub.policy.GammaPolicy` and sets it on the
   session's draft state (``state.gamma``; the proposer still cuts it to the context). A
   session at gamma 0 is answered at once, without model work, by a PROPOSAL with no tokens and
   ``alone`` = the span: its verdict is kept (:class:`~starsd.hub.policy.Pending`) and goes to
   the proposer with the session's next drafted job, the tokens decoded alone appended to it
   (and, for EAGLE, their feature rows), so proposers never see a gamma of 0;
4. drafts the rest with the real proposer and records the batch's S(B, longest g).

Nothing here changes what is proposed for a given gamma, nor the verdict a proposer applies, so
losslessness is the proposers' and the target's as before.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from starsd import protocol
from starsd.hub.drafters.base import DraftJob, Proposer
from starsd.hub.policy import GammaPolicy, Load, LoadMeter, Pending, ServiceModel, SessionPacing
from starsd.hub.sessions import SessionTable
from starsd.protocol import Error, Proposal, SamplingParams

_NO_TOKENS = np.zeros(0, dtype=np.int32)
_WAIT_SMOOTHING = 0.2  # W: weight of the newest queue wait
_ALONE_SMOOTHING = 0.3  # T_alone: weight of the newest span


class PacedProposer:
    """A :class:`~starsd.hub.drafters.base.Proposer` that chooses each job's gamma first.

    Anything else the engine asks of a proposer is passed through to the wrapped one.
    """

    def __init__(self, proposer: Proposer, table: SessionTable, lock: threading.Lock,
                 policy: GammaPolicy, backlog: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.inner = proposer
        self.kind = proposer.kind
        self.feature_width = proposer.feature_width
        self.max_positions = proposer.max_positions
        self.table = table
        self.lock = lock
        self.policy = policy
        self.backlog = backlog  # whether jobs were left queued when the batch was taken
        self.clock = clock  # the clock DraftJob.enqueued_at is read on
        self.service = ServiceModel()
        self.load = LoadMeter(policy.params.loaded_busy)

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> Any:
        return self.inner.new_state(prompt, params, gamma)

    def __getattr__(self, name: str) -> Any:  # whatever else a proposer offers
        if name == "inner":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, jobs: list[DraftJob]) -> list[Proposal | Error]:
        """Choose each job's gamma, answer gamma 0 at once, draft the rest; in order."""
        started = self.clock()
        loaded = self.load.start(started, self.backlog())
        pacings = self._pacings(jobs)
        costs = self.service.costs(len(jobs), self.policy.params.max_gamma)
        load = None if costs is None else Load(len(jobs), loaded, costs)
        results: dict[int, Proposal | Error] = {}
        drafted: list[tuple[int, DraftJob]] = []
        for i, (job, pacing) in enumerate(zip(jobs, pacings, strict=True)):
            if pacing is None:  # closed meanwhile: drafted as before, its result goes nowhere
                drafted.append((i, job))
                continue
            self._learn(job, pacing, started)
            # (after a span alone its verdict is held: this round is the probe)
            gamma = self.policy.next_round(pacing, load, probe=pacing.pending is not None)
            span = self._span(job, pacing) if gamma == 0 else 0
            if span:
                if pacing.pending is None:
                    pacing.pending = _pending(job)
                results[i] = Proposal(job.tag, job.seq, _NO_TOKENS, alone=span)
            else:
                job.state.gamma = max(gamma, 1)
                drafted.append((i, _with_pending(pacing, job)))
        if drafted:
            self._draft(drafted, results)
        sent = self.clock()
        self.load.finish(sent, sent - started)
        for i, pacing in enumerate(pacings):
            if pacing is not None:
                result = results[i]
                pacing.sent_at = sent
                pacing.last_gamma = len(result.tokens) if isinstance(result, Proposal) else -1
        return [results[i] for i in range(len(jobs))]

    def _pacings(self, jobs: list[DraftJob]) -> list[SessionPacing | None]:
        """Each job's session pacing, created on its first job (one lock hold per batch);
        None where the session is gone."""
        out: list[SessionPacing | None] = []
        with self.lock:
            sessions = self.table.sessions
            for job in jobs:
                session = sessions.get(job.tag)
                if session is None:
                    out.append(None)
                    continue
                if session.pacing is None:
                    gamma = job.state.gamma
                    session.pacing = self.policy.new_session(
                        gamma if session.gamma_fixed else None, start=gamma)
                out.append(session.pacing)
        return out

    def _learn(self, job: DraftJob, pacing: SessionPacing, started: float) -> None:
        """Update the session's estimates from ``job``; after a span alone, add the span's
        tokens (and feature rows) to the verdict held since then."""
        pacing.wait += _WAIT_SMOOTHING * (max(started - job.enqueued_at, 0.0) - pacing.wait)
        since = None if pacing.sent_at is None else job.enqueued_at - pacing.sent_at
        held = pacing.pending
        if held is not None:  # the DRAFT after a span alone: accepted 0, the span's tokens
            # (for a --gamma 0 session, one of several spans since it last drafted)
            held.appended.extend(job.appended)
            if job.features is not None:
                held.features.append(job.features)
            if since is not None and since > 0 and job.appended:
                step = since / len(job.appended)
                old = pacing.alone_step
                pacing.alone_step = step if old is None else old + _ALONE_SMOOTHING * (step - old)
            return
        # A verify commits exactly one token after the accepted ones: anything else means the
        # target decoded alone meanwhile (its deadline passed), which says nothing about either.
        if pacing.fixed is None and pacing.last_gamma >= 1 and len(job.appended) == 1:
            pacing.estimate.observe(pacing.last_gamma, min(job.accepted, pacing.last_gamma))
            if since is not None and since > 0:
                pacing.round_trip.observe(pacing.last_gamma, since)

    def _span(self, job: DraftJob, pacing: SessionPacing) -> int:
        """Tokens the session decodes alone now: its span, so that the DRAFT after it still
        fits the draft's context and one message; 0 when not even one fits (draft instead)."""
        span = min(pacing.alone_span, protocol.MAX_APPENDED - 1)
        limit = self.inner.max_positions
        if limit is not None:
            held = pacing.pending
            accepted, appended = ((held.accepted, held.appended) if held is not None
                                  else (job.accepted, job.appended))  # fmt: skip
            span = min(span, limit - (len(job.state.tokens) + accepted + len(appended)) - 1)
        return max(span, 0)

    def _draft(self, drafted: list[tuple[int, DraftJob]],
               results: dict[int, Proposal | Error]) -> None:  # fmt: skip
        started = self.clock()
        out = self.inner.propose([job for _, job in drafted])
        seconds = self.clock() - started
        longest = max((len(r.tokens) for r in out if isinstance(r, Proposal)), default=0)
        self.service.observe(len(drafted), longest, seconds)
        for (i, _), result in zip(drafted, out, strict=True):
            results[i] = result


def _pending(job: DraftJob) -> Pending:
    """The verdict ``job`` carries, held until the session drafts again."""
    features = [] if job.features is None else [job.features]
    return Pending(job.accepted, list(job.appended), features)


def _with_pending(pacing: SessionPacing, job: DraftJob) -> DraftJob:
    """``job`` with the verdict held since a span alone in its place (that verdict, then every
    token committed since, as if the target had sent them in one DRAFT); ``job`` if none."""
    held = pacing.pending
    if held is None:
        return job
    pacing.pending = None
    features = None
    if held.features:
        features = (held.features[0] if len(held.features) == 1
                    else np.concatenate(held.features))  # fmt: skip
    return dataclasses.replace(job, accepted=held.accepted, appended=tuple(held.appended),
                               features=features)  # fmt: skip
