"""The drafting thread: take a batch from Q_in, run its round, deliver and send the proposals.

This module is the drafting thread's whole room, and :meth:`DraftingEngine.serve` is one round,
top to bottom::

    load    = pacer.load(batch)                 # the batch as the policy sees it
    plans   = [pacer.plan(job) for job in batch]  # learn from each verdict, choose gamma / a span
    answers = spans alone + predrafter.answer(job) for the rest   # no model work
    drafted = proposer.propose(the rest)        # one batched forward sequence
    with lock: deliver(answers + drafted)       # the session table, counters and sends
    predrafter.offer(what went out)             # what to pre-draft while idle

It runs the model (the event loop never does) and delivers its own results: under the hub lock it
updates the session and sends the proposal with a NOBLOCK send, so Q_out is the ROUTER's
per-target outgoing queues, drained by ZeroMQ's I/O thread while the next batch is drafted.
Sending from here spares every round a wake-up of the event loop. The lock is taken twice per
batch that drafts (to mark the drafting busy, then to deliver), once per batch that does not,
never across model work. Its collaborators are plain: the pacer (``--gamma auto``,
:mod:`starsd.hub.pacing`), the proposer (:mod:`starsd.hub.drafters`) and the pre-drafter
(:mod:`starsd.hub.predraft`); each session's draft state, its pacing included, belongs to this
thread.

Work-conserving: the thread drafts whenever any target has a job queued and never waits for one
target's verdict or for the network (but for gathering: at most one batch's service time for
verdicts due by then, :mod:`starsd.gather`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from starsd import protocol
from starsd.gather import Returns
from starsd.hub.drafters.base import DraftJob, Proposer
from starsd.hub.pacing import Pacer, Plan
from starsd.hub.scheduler import FairQueue
from starsd.hub.sessions import SessionTable
from starsd.protocol import Error, ErrorCode, Proposal
from starsd.stats import HubStats

if TYPE_CHECKING:  # the engine only calls it; build.py makes one for draft-LLM hubs
    from starsd.hub.predraft import Predrafter

log = logging.getLogger("starsd.hub")

_SERVICE_SMOOTHING = 0.2  # weight of the newest batch in the gathering window
_GATHER_SLACK_S = 0.002  # wait this long past the last due verdict (arrival jitter)
_NO_TOKENS = np.zeros(0, dtype=np.int32)

Send = Callable[[bytes, protocol.Message], bool]  # the hub's reply path; lock held
Result = Proposal | Error


class DraftingEngine:
    """Owns the drafting thread; shares the session table and counters under ``lock``."""

    def __init__(
        self,
        proposer: Proposer,
        pacer: Pacer,
        q_in: FairQueue[DraftJob],
        table: SessionTable,
        lock: threading.Lock,
        send: Send,
        stats: HubStats,
        max_batch: int = 1,
        predrafter: Predrafter | None = None,
        gather: bool = True,
    ) -> None:
        self.proposer = proposer
        self.pacer = pacer
        self.predrafter = predrafter  # the drafting thread's own; None: no pre-drafting
        self.returns = Returns() if gather and max_batch > 1 else None  # drafting thread's own
        self.service_s = 0.0  # smoothed service time of a drafted batch: the gathering window
        self.max_batch = max_batch
        self.q_in = q_in
        self.table = table
        self.lock = lock
        self.send = send
        self.stats = stats
        self.clock = pacer.clock
        self.thread = threading.Thread(target=self.run, name="drafter")
        if predrafter is not None:
            predrafter.connect_push(self._push)

    def start(self) -> None:
        """Start the drafting thread; it ends once Q_in is closed and empty."""
        self.thread.start()

    def run(self) -> None:
        """The drafting thread's loop (entry point of the thread)."""
        # Every waiting job up to max_batch, one per target in turn: the proposer drafts them
        # in one batched forward, which costs little more than one job alone. With no job
        # waiting, one pre-draft forward at a time, so a job that arrives waits for one step.
        while (batch := self._next_batch()) is not None:
            if batch:
                self._serve_or_fail(batch)
            else:
                self._predraft()

    def _serve_or_fail(self, batch: list[DraftJob]) -> None:
        """One round; a round that raises (a proposer bug, the device out of memory) ends
        its sessions with INTERNAL, which their targets re-open, and the thread drafts on: a
        dead drafting thread would leave every target waiting on a hub that answers nothing."""
        try:
            self.serve(batch)
        except Exception:
            log.exception("drafting a batch of %d failed; ending its sessions", len(batch))
            self._fail(batch)

    def _fail(self, batch: list[DraftJob]) -> None:
        """Send each job of a failed round INTERNAL (its session is dropped: its draft state
        may be half-advanced, and so may any pre-drafted branch)."""
        if self.predrafter is not None:
            self.predrafter.drop_all()
        started, problem = self.clock(), "drafting failed on the hub; re-open the session"
        with self.lock:
            self.stats.rounds_failed += len(batch)
            for job in batch:
                error = Error(ErrorCode.INTERNAL, problem, tag=job.tag, seq=job.seq)
                self._deliver_one(job, error, started, hit=False)

    # ------------------------------------------------------------------ the round

    def serve(self, batch: list[DraftJob]) -> list[Result]:
        """One round for ``batch`` (see the module docstring); returns each job's result."""
        started, cpu_started = self.clock(), time.thread_time()
        load = self.pacer.load(len(batch), self.q_in.backlog(), started)
        plans = [self.pacer.plan(job, load, started) for job in batch]
        results, hits = self._answer(batch, plans)
        todo = [i for i in range(len(batch)) if i not in results]
        if todo:
            with self.lock:  # the load report counts a batch being drafted as busy
                self.stats.batch_started = started
            self._draft(batch, todo, results)
        sent = self._deliver(batch, results, hits, started, cpu_started, len(todo))
        now = self.clock()
        self.pacer.finished(now, now - started)
        for job in batch:
            self.pacer.sent(job, now)
        if todo:
            self.service_s += _SERVICE_SMOOTHING * (now - started - self.service_s)
        self._remember_sent(batch, results, sent, now)
        self._offer(batch, plans, results, sent)
        return [results[i] for i in range(len(batch))]

    def _answer(
        self, batch: list[DraftJob], plans: list[Plan]
    ) -> tuple[dict[int, Result], set[int]]:
        """What needs no model work: spans alone, and verdicts a pre-drafted branch holds
        (those are the second value). A verdict whose target took a pushed branch the hub no
        longer holds (rare: its waiting sessions are bounded) ends the session: drafting it
        afresh could differ from the branch (batched float rounding) and leave the hub's
        tokens silently wrong; its target re-opens from its own tokens."""
        results: dict[int, Result] = {}
        hits: set[int] = set()
        predrafter = self.predrafter
        for i, (job, plan) in enumerate(zip(batch, plans, strict=True)):
            tree = job.state.tree is not None  # this round drafts a token tree
            if predrafter is not None and (plan.held or tree):
                predrafter.forget(job.tag)
            if plan.alone:
                results[i] = Proposal(job.tag, job.seq, _NO_TOKENS, alone=plan.alone)
                continue
            hit = None if plan.held or tree or predrafter is None else predrafter.answer(job)
            if hit is not None:
                results[i] = hit
                hits.add(i)
            elif job.taken:
                results[i] = Error(
                    ErrorCode.UNKNOWN_SESSION,
                    "the pushed branch this verdict took is no longer held; re-open the session",
                    tag=job.tag,
                    seq=job.seq,
                )
        return results, hits

    def _draft(self, batch: list[DraftJob], todo: list[int], results: dict[int, Result]) -> None:
        """Draft the jobs at ``todo`` in one batch (a span's held verdict merged in first)."""
        jobs = [self.pacer.with_held(batch[i]) for i in todo]
        started = self.clock()
        proposals = self.proposer.propose(jobs)
        longest = max((len(r.tokens) for r in proposals if isinstance(r, Proposal)), default=0)
        self.pacer.drafted(len(jobs), longest, self.clock() - started)
        results.update(zip(todo, proposals, strict=True))

    def _deliver(
        self,
        batch: list[DraftJob],
        results: dict[int, Result],
        hits: set[int],
        started: float,
        cpu_started: float,
        drafted: int,
    ) -> list[DraftJob]:
        """Every result delivered under one hold of the lock; the jobs whose proposal went out."""
        with self.lock:
            sent = [
                job
                for i, job in enumerate(batch)
                if self._deliver_one(job, results[i], started, hit=i in hits)
            ]
            if drafted:  # busy time is the batch's whole service, delivery included: S(B)
                self.stats.record_batch(
                    drafted, self.clock() - started, time.thread_time() - cpu_started
                )
        return sent

    def _deliver_one(self, job: DraftJob, result: Result, started: float, hit: bool) -> bool:
        """Update the session and send ``result`` (lock held); True if a proposal went out."""
        proposed = len(result.tokens) if isinstance(result, Proposal) else None
        taken = hit and job.taken > 0  # (the table moved on when the DRAFT came)
        session = (
            self.table.sessions.get(job.tag)
            if taken
            else self.table.delivered(job.tag, job.seq, proposed, _parents(result))
        )
        if session is None:  # closed while drafting: nothing to send, state is already dropped
            return False
        peer = self.table.peers.get(session.routing_id)
        if peer is not None:
            peer.stats.jobs += 1
            peer.stats.queue_wait_s += started - job.enqueued_at
            peer.stats.predraft_hits += hit
            peer.stats.taken += taken
        # (a taken branch is the proposal its target is verifying already: nothing to send)
        sent = taken or self.send(session.routing_id, result)
        if not sent and proposed is not None:  # (an error result ended its session already)
            # The target will not see this proposal: free the state now; the target re-opens
            # from its own tokens when its DRAFT gets UNKNOWN_SESSION or its deadline passes.
            self.table.drop(session)
            self.stats.sessions_dropped += 1
        return sent and proposed is not None

    def _remember_sent(
        self, batch: list[DraftJob], results: dict[int, Result], sent: list[DraftJob], now: float
    ) -> None:
        """When proposals left, for gathering (not spans the target decodes alone)."""
        if self.returns is None:
            return
        out = set(map(id, sent))
        for i, job in enumerate(batch):
            result = results[i]
            if id(job) in out and isinstance(result, Proposal) and not result.alone:
                self.returns.sent(job.tag, now, cohort=job.owner or None)

    def _offer(
        self,
        batch: list[DraftJob],
        plans: list[Plan],
        results: dict[int, Result],
        sent: list[DraftJob],
    ) -> None:
        """Sessions whose proposals went out: their likely verdicts are pre-drafted when idle
        (not a span alone: its session's draft state is not the proposal out; not a token
        tree: its verdicts are a path each, too many to draft ahead, and the tree round was
        chosen because drafting is not the bottleneck)."""
        if self.predrafter is None:
            return
        out = set(map(id, sent))
        for i, (job, plan) in enumerate(zip(batch, plans, strict=True)):
            result = results[i]
            if (
                id(job) in out
                and not plan.alone
                and isinstance(result, Proposal)
                and result.parents is None
            ):
                self.predrafter.offer(job.tag, job.state, job.seq + 1, job.push)

    # ------------------------------------------------------------------ taking a batch

    def _next_batch(self) -> list[DraftJob] | None:
        batch = self.q_in.take(self.max_batch, block=not self._idle_work())
        return self._gathered(batch) if batch and self.returns is not None else batch

    def _gathered(self, batch: list[DraftJob]) -> list[DraftJob]:
        """``batch`` plus the jobs of sessions whose verdicts are due within one batch's
        service time (see :mod:`starsd.gather`): one batch instead of two in turn. A target's
        sessions are a cohort: its verdicts on one forward come back to back."""
        assert self.returns is not None
        arrivals = [self.returns.arrived(job.tag, job.enqueued_at) for job in batch]
        room = self.max_batch - len(batch)
        if room <= 0:
            return batch
        with self.lock:  # a session closed with its proposal out never answers: not waited for
            sessions = self.table.sessions
            self.returns.prune(lambda tag: tag in sessions)
        now = time.perf_counter()
        due, latest = self.returns.due(now, self.service_s, arrivals)
        if due == 0:
            return batch
        self.q_in.wait_for(min(due, room), min(now + self.service_s, latest + _GATHER_SLACK_S))
        more = self.q_in.take(room, block=False) or []
        for job in more:
            self.returns.arrived(job.tag, job.enqueued_at)
        return batch + more

    # ------------------------------------------------------------------ pre-drafting

    def _idle_work(self) -> bool:
        """Whether a pre-draft step would do anything now; first, past its limit of proposals
        out, the pre-drafter forgets sessions closed meanwhile (only the table knows those)."""
        predrafter = self.predrafter
        if predrafter is None:
            return False
        if predrafter.over_limit():
            with self.lock:
                sessions = self.table.sessions
                predrafter.prune(lambda tag: tag in sessions)
        return predrafter.has_work()

    def _predraft(self) -> None:
        assert self.predrafter is not None
        self.predrafter.step()
        with self.lock:
            self.stats.predraft_s = self.predrafter.stats.busy_s

    def _push(self, tag: bytes, proposals: list[Proposal]) -> int:
        """Send a session's pushed branches to its target (drafting thread, from the
        pre-drafter); how many went out (hub stats ``pushed``). None once its verdict is in, too
        late to help (counted ``push_late``), or its session is gone."""
        with self.lock:
            session = self.table.sessions.get(tag)
            if session is None or session.in_flight:
                self.stats.push_late += len(proposals)
                return 0
            sent = 0
            while sent < len(proposals) and self.send(session.routing_id, proposals[sent]):
                sent += 1
            self.stats.pushed += sent
            return sent


def _parents(result: Result) -> np.ndarray | None:
    """A proposal's token tree (None: a chain, or an error)."""
    return result.parents if isinstance(result, Proposal) else None
