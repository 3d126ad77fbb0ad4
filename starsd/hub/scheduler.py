"""Q_in, the hub's global request queue: draft jobs taken round-robin across targets.

A plain FIFO is work-conserving but lets a target with many sessions (or a burst of requests)
take most of the drafting time. Here every target has its own FIFO and the drafting thread
takes one job per target in turn, so each target waits at most one job per other target between
two of its own, however chatty the others are. Bounded: the hub admits at most one job in
flight per session (two right after its target took a pushed branch: that commit, then the next
verdict, in order) and a quota of sessions per target, and removes a session's queued job when
the session ends (so no target has more than two queued jobs per live session).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Thread-safe per-owner FIFOs, served round-robin; ``take`` blocks until work or close.

    A waiting taker sleeps on a C-level queue (the doorbell), rung by ``put`` only when someone
    waits: unlike ``threading.Condition``, the woken taker does not then block again on a lock
    the putter still holds, so a hand-off costs one thread wake-up, not two.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: OrderedDict[Hashable, deque[T]] = OrderedDict()  # non-empty deques only
        self._closed = False
        self._size = 0  # jobs queued
        self._waiting = 0  # takers asleep on the doorbell, or about to be
        self._doorbell: queue.SimpleQueue[None] = queue.SimpleQueue()

    def put(self, owner: Hashable, job: T) -> None:
        """Queue ``job`` behind ``owner``'s earlier jobs."""
        with self._lock:
            self._queues.setdefault(owner, deque()).append(job)
            self._size += 1
            ring = self._waiting > 0
            if ring:
                self._waiting -= 1
        if ring:  # outside the lock, so the woken taker finds it free
            self._doorbell.put(None)

    def remove(self, owner: Hashable, unwanted: Callable[[T], bool]) -> int:
        """Drop ``owner``'s queued jobs for which ``unwanted`` is true; returns how many."""
        with self._lock:
            jobs = self._queues.get(owner)
            if not jobs:
                return 0
            kept = deque(job for job in jobs if not unwanted(job))
            if kept:
                self._queues[owner] = kept  # keeps its place in the round
            else:
                del self._queues[owner]
            self._size -= len(jobs) - len(kept)
            return len(jobs) - len(kept)

    def clear(self) -> int:
        """Drop every queued job (a drain that ran out of time); returns how many."""
        with self._lock:
            dropped = sum(len(jobs) for jobs in self._queues.values())
            self._queues.clear()
            self._size = 0
            return dropped

    def backlog(self) -> bool:
        """Whether any job is queued now (right after a take: more were waiting than it took)."""
        with self._lock:
            return bool(self._queues)

    def take(self, limit: int, block: bool = True) -> list[T] | None:
        """Up to ``limit`` jobs, one per owner in turn; None once closed and empty. Without
        ``block``, an empty list when nothing is queued."""
        while True:
            with self._lock:
                if self._queues or self._closed or not block:
                    return self._take_now(limit)
                self._waiting += 1
            self._doorbell.get()  # a put or close rings once for each waiting taker

    def _take_now(self, limit: int) -> list[T] | None:
        batch: list[T] = []
        while self._queues and len(batch) < limit:
            batch.append(self._next())
        return batch if batch or not self._closed else None

    def _next(self) -> T:
        owner, jobs = next(iter(self._queues.items()))
        job = jobs.popleft()
        self._size -= 1
        del self._queues[owner]
        if jobs:
            self._queues[owner] = jobs  # to the back of the round
        return job

    def wait_for(self, count: int, deadline: float) -> None:
        """Block until ``count`` jobs are queued, the queue is closed, or ``time.perf_counter()``
        reaches ``deadline``. For the one taker (the drafting thread)."""
        while True:
            with self._lock:
                timeout = deadline - time.perf_counter()
                if self._size >= count or self._closed or timeout <= 0:
                    return
                self._waiting += 1
            try:
                self._doorbell.get(timeout=timeout)
            except queue.Empty:
                with self._lock:  # not rung: withdraw (a ring that raced us leaves a spare
                    self._waiting = max(0, self._waiting - 1)  # wake-up; takers re-check)

    def __len__(self) -> int:
        with self._lock:
            return self._size

    def close(self) -> None:
        """Wake every taker; jobs still queued are taken first, then ``take`` returns None."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, 0
        for _ in range(waiting):
            self._doorbell.put(None)
