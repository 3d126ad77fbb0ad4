"""Q_in, the hub's global request queue: draft jobs taken round-robin across targets.

A plain FIFO is work-conserving but lets a target with many sessions (or a burst of requests)
take most of the drafting time. Here every target has its own FIFO and the drafting thread
takes one job per target in turn, so each target waits at most one job per other target between
two of its own, however chatty the others are. Bounded: the hub admits at most one job in
flight per session and a quota of sessions per target.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Thread-safe per-owner FIFOs, served round-robin; ``take`` blocks until work or close."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: OrderedDict[Hashable, deque[T]] = OrderedDict()  # non-empty deques only
        self._closed = False

    def put(self, owner: Hashable, job: T) -> None:
        """Queue ``job`` behind ``owner``'s earlier jobs."""
        with self._cond:
            self._queues.setdefault(owner, deque()).append(job)
            self._cond.notify()

    def take(self, limit: int) -> list[T] | None:
        """Up to ``limit`` jobs, one per owner in turn; None once closed and empty."""
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()
            batch: list[T] = []
            while self._queues and len(batch) < limit:
                batch.append(self._next())
            return batch if batch or not self._closed else None

    def _next(self) -> T:
        owner, jobs = next(iter(self._queues.items()))
        job = jobs.popleft()
        del self._queues[owner]
        if jobs:
            self._queues[owner] = jobs  # to the back of the round
        return job

    def close(self) -> None:
        """Wake the taker; jobs still queued are taken first, then ``take`` returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
