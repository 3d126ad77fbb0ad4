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

With pre-drafting (draft LLM hubs), :class:`PacedPredrafter` stands in for the engine's
pre-drafter: the engine asks it about each job first, so steps 1-3 happen there (the decision is
kept on the session's pacing for ``propose``), and a pre-drafted branch answers a job only when
the round's gamma is at most the branch's own, never at gamma 0 or with a verdict held.

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
from starsd.hub.sessions import SessionTable
from starsd.protocol import Error, Proposal, SamplingParams

_NO_TOKENS = np.zeros(0, dtype=np.int32)
_WAIT_SMOOTHING = 0.2  # W: weight of the newest queue wait
_ALONE_SMOOTHING = 0.3  # T_alone: weight of the newest span
_HUB_ALONE_SMOOTHING = 0.1  # the hub's T_alone, over every session's spans


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
        self.owners = OwnerMemory()  # each target's latest auto session: its next starts there
        self.common = CommonGamma(policy.params.max_gamma)  # what the auto sessions draft
        self.alone_s: float | None = None  # T_alone over the hub's sessions (smoothed)
        self.batch = 1  # the last batch's size

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> Any:
        return self.inner.new_state(prompt, params, gamma)

    def __getattr__(self, name: str) -> Any:  # whatever else a proposer offers
        if name == "inner":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, jobs: list[DraftJob]) -> list[Proposal | Error]:
        """Choose each job's gamma (unless its pre-drafter call did), answer gamma 0 at once,
        draft the rest; in order."""
        started = self.clock()
        loaded = self.load.start(started, self.backlog())
        self.batch = len(jobs)
        pacings = self._pacings(jobs)
        load = self._load(len(jobs), loaded)
        results: dict[int, Proposal | Error] = {}
        drafted: list[tuple[int, DraftJob]] = []
        for i, (job, pacing) in enumerate(zip(jobs, pacings, strict=True)):
            if pacing is None:  # closed meanwhile: drafted as before, its result goes nowhere
                drafted.append((i, job))
                continue
            decided = pacing.decision
            pacing.decision = None
            gamma, span = (decided[1:] if decided is not None and decided[0] == job.seq
                           else self.decide(job, pacing, load, started))  # fmt: skip
            if span:
                if pacing.pending is None:
                    pacing.pending = _pending(job)
                results[i] = Proposal(job.tag, job.seq, _NO_TOKENS, alone=span)
            else:
                job.state.gamma = gamma
                drafted.append((i, _with_pending(pacing, job)))
        if drafted:
            self._draft(drafted, results)
        sent = self.clock()
        self.load.finish(sent, sent - started)
        for i, pacing in enumerate(pacings):
            if pacing is not None:
                result = results[i]
                self.sent(pacing, len(result.tokens) if isinstance(result, Proposal) else -1, sent)
        return [results[i] for i in range(len(jobs))]

    def decide(self, job: DraftJob, pacing: SessionPacing, load: Load | None,
               now: float) -> tuple[int, int]:  # fmt: skip
        """Learn from ``job``, then this round's (gamma to draft, span alone): exactly one of
        them is 0. Kept on ``pacing.decision`` until the job is answered."""
        self._learn(job, pacing, now)
        # (after a span alone its verdict is held: this round is the probe)
        gamma = self.policy.next_round(pacing, load, probe=pacing.pending is not None)
        if pacing.fixed is None:
            self.common.vote(gamma)
        span = self._span(job, pacing) if gamma == 0 else 0
        decision = (0, span) if span else (max(gamma, 1), 0)
        pacing.decision = (job.seq, *decision)
        return decision

    def sent(self, pacing: SessionPacing, proposed: int, now: float) -> None:
        """A proposal of ``proposed`` tokens (0: a span alone, -1: an error) left at ``now``."""
        pacing.sent_at = now
        pacing.last_gamma = proposed
        pacing.decision = None

    def pacing_of(self, job: DraftJob) -> SessionPacing | None:
        """The session pacing of one job (see _pacings)."""
        return self._pacings([job])[0]

    def current_load(self) -> Load | None:
        """The load for a decision made before the batch reaches :meth:`propose` (by the
        pre-drafter): B is the last batch's size, the regime as of the last batch."""
        return self._load(self.batch, self.load.loaded(self.backlog()))

    def _load(self, batch: int, loaded: bool) -> Load | None:
        costs = self.service.costs(batch, self.policy.params.max_gamma)
        return None if costs is None else Load(batch, loaded, costs, self.common.mode(),
                                               self.alone_s)  # fmt: skip

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
                    session.pacing = self._new_pacing(session.owner, job.state.gamma,
                                                      session.gamma_fixed)  # fmt: skip
                out.append(session.pacing)
        return out

    def _new_pacing(self, owner: bytes, gamma: int, fixed: bool) -> SessionPacing:
        """A new session's pacing: a fixed one keeps ``gamma``; an auto one starts from its
        target's latest auto session, if any, and is the target's latest from now on."""
        if fixed:
            return self.policy.new_session(gamma)
        pacing = self.policy.new_session(None, start=gamma, like=self.owners.get(owner))
        self.owners.put(owner, pacing)
        return pacing

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
                hub = self.alone_s
                self.alone_s = step if hub is None else hub + _HUB_ALONE_SMOOTHING * (step - hub)
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


class PacedPredrafter:
    """The engine's pre-drafter (:class:`starsd.hub.predraft.Predrafter`) behind the policy.

    The engine asks it to answer each job from a pre-drafted branch before anything is drafted,
    so the policy decides the round here first (:meth:`PacedProposer.decide`; ``propose`` then
    uses that decision). A branch answers a round that drafts at most the branch's own gamma
    (its first tokens; under auto a branch drafts one more than its session's gamma, for a round
    whose gamma grows): the pre-drafter matches against ``state.gamma``, which the decision sets
    (0 for a span alone, which no branch answers). A session whose verdict is held since a span
    alone is neither answered nor offered: its ``state.proposed`` is not the proposal its target
    is answering. Anything else is the pre-drafter's own.
    Drafting thread only, like the pre-drafter.
    """

    def __init__(self, inner: Any, paced: PacedProposer) -> None:
        self.inner = inner
        self.paced = paced

    def __getattr__(self, name: str) -> Any:  # has_work, step, stats, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def has_work(self) -> bool:
        """The pre-drafter's, once it has forgotten the sessions closed meanwhile (only the
        table knows those; looked up only when the count matters)."""
        inner = self.inner
        if inner.over_limit():
            with self.paced.lock:
                sessions = self.paced.table.sessions
                inner.prune(lambda tag: tag in sessions)
        return bool(inner.has_work())

    def answer(self, job: DraftJob) -> Proposal | None:
        """The proposal for ``job`` from a branch at the gamma chosen now, or None."""
        paced = self.paced
        pacing = paced.pacing_of(job)
        if pacing is None:
            return self.inner.answer(job)  # type: ignore[no-any-return]
        if job.taken:  # the target verifies a pushed branch already: its gamma is decided
            return self._taken(job, pacing)
        gamma, _ = paced.decide(job, pacing, paced.current_load(), paced.clock())
        if pacing.pending is not None:
            return None
        job.state.gamma = gamma
        hit: Proposal | None = self.inner.answer(job)
        if hit is not None:
            paced.sent(pacing, len(hit.tokens), paced.clock())
        return hit

    def _taken(self, job: DraftJob, pacing: SessionPacing) -> Proposal | None:
        """A verdict whose target took a pushed branch: learn from it, commit the branch."""
        paced = self.paced
        now = paced.clock()
        paced._learn(job, pacing, now)
        hit: Proposal | None = self.inner.answer(job)
        paced.sent(pacing, len(hit.tokens) if hit is not None else -1, now)
        return hit

    def offer(self, tag: bytes, state: Any, seq: int = 0, push: int = 0) -> None:
        """Pre-draft the session's likely verdicts, unless its proposal out is a span alone."""
        with self.paced.lock:
            session = self.paced.table.sessions.get(tag)
            held = session is not None and session.pacing is not None and (
                session.pacing.pending is not None)  # fmt: skip
        if not held:
            self.inner.offer(tag, state, seq, push)


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
