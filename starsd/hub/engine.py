"""The drafting thread: take a job from Q_in, draft it, deliver and send the proposal.

This module is the drafting thread's whole room. It runs the model (the event loop never does)
and delivers its own results: under the hub lock it updates the session and sends the proposal
with a NOBLOCK send, so Q_out is the ROUTER's per-target outgoing queues, drained by ZeroMQ's I/O
thread while the next job is drafted. Sending from here spares every round a wake-up of the event
loop. The lock is held for delivery only, never across model work.

Work-conserving: the thread drafts whenever any target has a job queued and never waits for one
target's verdict or for the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from starsd import protocol
from starsd.gather import Returns
from starsd.hub.drafters.base import DraftJob, Proposer
from starsd.hub.scheduler import FairQueue
from starsd.hub.sessions import SessionTable
from starsd.protocol import Error, ErrorCode, Proposal
from starsd.stats import HubStats

if TYPE_CHECKING:  # the engine only calls it; build.py makes one for draft-LLM hubs
    from starsd.hub.predraft import Predrafter

log = logging.getLogger("starsd.hub")

_SERVICE_SMOOTHING = 0.2  # weight of the newest batch in the gathering window
_GATHER_SLACK_S = 0.002  # wait this long past the last due verdict (arrival jitter)

Send = Callable[[bytes, protocol.Message], bool]  # the hub's reply path; lock held


class DraftingEngine:
    """Owns the drafting thread; shares the session table and counters under ``lock``."""

    def __init__(self, proposer: Proposer, q_in: FairQueue[DraftJob], table: SessionTable,
                 lock: threading.Lock, send: Send, stats: HubStats, max_batch: int = 1,
                 predrafter: Predrafter | None = None, gather: bool = True) -> None:  # fmt: skip
        self.proposer = proposer
        self.returns = Returns() if gather and max_batch > 1 else None  # drafting thread's own
        self.service_s = 0.0  # smoothed service time of a drafted batch: the gathering window
        self.max_batch = max_batch
        self.predrafter = predrafter  # the drafting thread's own; None: no pre-drafting
        self.q_in = q_in
        self.table = table
        self.lock = lock
        self.send = send
        self.stats = stats
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
                self._serve(batch)
            else:
                self._predraft()

    def _next_batch(self) -> list[DraftJob] | None:
        idle_work = self.predrafter is not None and self.predrafter.has_work()
        batch = self.q_in.take(self.max_batch, block=not idle_work)
        return self._gathered(batch) if batch and self.returns is not None else batch

    def _gathered(self, batch: list[DraftJob]) -> list[DraftJob]:
        """``batch`` plus the jobs of sessions whose verdicts are due within one batch's
        service time (see :mod:`starsd.gather`): one batch instead of two in turn."""
        assert self.returns is not None
        for job in batch:
            self.returns.arrived(job.tag, job.enqueued_at)
        room = self.max_batch - len(batch)
        now = time.perf_counter()
        due, latest = self.returns.due(now, self.service_s)
        if room <= 0 or due == 0:
            return batch
        self.q_in.wait_for(min(due, room), min(now + self.service_s, latest + _GATHER_SLACK_S))
        more = self.q_in.take(room, block=False) or []
        for job in more:
            self.returns.arrived(job.tag, job.enqueued_at)
        return batch + more

    def _serve(self, batch: list[DraftJob]) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        hits = self._answered(batch)  # from pre-drafted branches: no model work
        results = {**hits, **_lost_branches(batch, hits)}
        drafted = [i for i in range(len(batch)) if i not in results]
        if drafted:
            with self.lock:
                self.stats.batch_started = started
            proposals = self.proposer.propose([batch[i] for i in drafted])
            results.update(zip(drafted, proposals, strict=True))
        with self.lock:
            sent = [job for i, job in enumerate(batch)
                    if self._deliver(job, results[i], started, hit=i in hits)]  # fmt: skip
            if drafted:  # busy time is the batch's whole service, delivery included: S(B)
                self.stats.record_batch(len(drafted), time.perf_counter() - started,
                                        time.thread_time() - cpu_started)  # fmt: skip
        if drafted:
            self.service_s += _SERVICE_SMOOTHING * (time.perf_counter() - started - self.service_s)
        self._sent(sent, results, batch)
        self._offer(sent)

    def _sent(self, sent: list[DraftJob], results: dict[int, Proposal | Error],
              batch: list[DraftJob]) -> None:  # fmt: skip
        """Remember when proposals left, for gathering (not spans the target decodes alone)."""
        if self.returns is None:
            return
        now, out = time.perf_counter(), set(map(id, sent))
        for i, job in enumerate(batch):
            result = results[i]
            if id(job) in out and isinstance(result, Proposal) and not result.alone:
                self.returns.sent(job.tag, now)

    def _deliver(self, job: DraftJob, result: Proposal | Error, started: float,
                 hit: bool) -> bool:  # fmt: skip
        """Update the session and send ``result`` (lock held); True if a proposal went out."""
        proposed = len(result.tokens) if isinstance(result, Proposal) else None
        taken = hit and job.taken > 0  # (the table moved on when the DRAFT came)
        session = (self.table.sessions.get(job.tag) if taken
                   else self.table.delivered(job.tag, job.seq, proposed))  # fmt: skip
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

    # ------------------------------------------------------------------ pre-drafting

    def _answered(self, batch: list[DraftJob]) -> dict[int, Proposal | Error]:
        """Jobs whose verdict matches a pre-drafted branch, answered from it."""
        if self.predrafter is None:
            return {}
        hits: dict[int, Proposal | Error] = {}
        for i, job in enumerate(batch):
            proposal = self.predrafter.answer(job)
            if proposal is not None:
                hits[i] = proposal
        return hits

    def _offer(self, sent: list[DraftJob]) -> None:
        """Sessions whose proposals went out: their likely verdicts are pre-drafted when idle."""
        if self.predrafter is not None:
            for job in sent:
                self.predrafter.offer(job.tag, job.state, job.seq + 1, job.push)

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

    def _predraft(self) -> None:
        assert self.predrafter is not None
        self.predrafter.step()
        with self.lock:
            self.stats.predraft_s = self.predrafter.stats.busy_s


def _lost_branches(batch: list[DraftJob], hits: dict[int, Proposal | Error]
                   ) -> dict[int, Proposal | Error]:  # fmt: skip
    """Jobs whose target took a pushed branch the hub no longer holds (rare: its waiting
    sessions are bounded): the session cannot be kept in step, so it ends and its target
    re-opens from its own tokens. Drafting it afresh could differ from the branch (batched
    float rounding) and leave the hub's tokens silently wrong."""
    return {i: Error(ErrorCode.UNKNOWN_SESSION, "the pushed branch this verdict took is no "
                     "longer held; re-open the session", tag=job.tag, seq=job.seq)
            for i, job in enumerate(batch) if job.taken and i not in hits}  # fmt: skip
