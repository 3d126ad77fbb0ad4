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

from starsd import protocol
from starsd.hub.drafters.base import DraftJob, Proposer
from starsd.hub.scheduler import FairQueue
from starsd.hub.sessions import SessionTable
from starsd.protocol import Error, Proposal
from starsd.stats import HubStats

log = logging.getLogger("starsd.hub")

Send = Callable[[bytes, protocol.Message], bool]  # the hub's reply path; lock held


class DraftingEngine:
    """Owns the drafting thread; shares the session table and counters under ``lock``."""

    def __init__(self, proposer: Proposer, q_in: FairQueue[DraftJob], table: SessionTable,
                 lock: threading.Lock, send: Send, stats: HubStats,
                 max_batch: int = 1) -> None:  # fmt: skip
        self.proposer = proposer
        self.max_batch = max_batch
        self.q_in = q_in
        self.table = table
        self.lock = lock
        self.send = send
        self.stats = stats
        self.thread = threading.Thread(target=self.run, name="drafter")

    def start(self) -> None:
        """Start the drafting thread; it ends once Q_in is closed and empty."""
        self.thread.start()

    def run(self) -> None:
        """The drafting thread's loop (entry point of the thread)."""
        # Every waiting job up to max_batch, one per target in turn: the proposer drafts them
        # in one batched forward, which costs little more than one job alone.
        while (batch := self.q_in.take(self.max_batch)) is not None:
            self._serve(batch)

    def _serve(self, batch: list[DraftJob]) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        with self.lock:
            self.stats.batch_started = started
        results = self.proposer.propose(batch)
        with self.lock:
            for job, result in zip(batch, results, strict=True):
                self._deliver(job, result, started)
            # Busy time is the whole service of the batch, delivery included: S(d) of the model.
            self.stats.record_batch(len(batch), time.perf_counter() - started,
                                    time.thread_time() - cpu_started)  # fmt: skip

    def _deliver(self, job: DraftJob, result: Proposal | Error, started: float) -> None:
        proposed = len(result.tokens) if isinstance(result, Proposal) else None
        session = self.table.delivered(job.tag, job.seq, proposed)
        if session is None:  # closed while drafting: nothing to send, state is already dropped
            return
        peer = self.table.peers.get(session.routing_id)
        if peer is not None:
            peer.stats.jobs += 1
            peer.stats.queue_wait_s += started - job.enqueued_at
        sent = self.send(session.routing_id, result)
        if not sent and proposed is not None:  # (an error result ended its session already)
            # The target will not see this proposal: free the state now; the target re-opens
            # from its own tokens when its DRAFT gets UNKNOWN_SESSION or its deadline passes.
            self.table.drop(session)
            self.stats.sessions_dropped += 1
