"""One model thread for every sequence of a target: pending work runs as one batched forward.

Sequences in flight (each its own coroutine, :mod:`edge.speculate`) submit work items: prefill,
"step alone" or "verify this proposal". One worker task takes everything pending (up to
``max_batch`` rows) and runs it as ONE backend forward in the model thread, then resolves each
item's future; what arrives meanwhile waits for the next forward. Prefills (long feeds) run in
forwards of their own, so decoding rows are not padded to a prompt.

Gathering (``gather``, on by default; :mod:`starsd.gather`, the hub's rule): before a decoding
forward the worker waits, at most one forward's (smoothed) time, for the sequences whose
proposals are due back from the hub by then (each sequence's round trip is measured from its
verification to its next item), never for an overdue one. Without it the sequences of a target
split into groups that take turns. Measured (default pair, one hub, one target at
--concurrency 8, 200 tokens, alternated): 6.9 rows per forward against 3.5 and half the
forwards, 739-799 tok/s against 728-756.

Every sequence has at most one item in flight (its coroutine awaits each), and only the model
thread touches a sequence while its item runs; the event loop reads it between items.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from edge import verifier
from edge.backends.base import VerifierBackend
from edge.verifier import TargetSequence
from starsd import transport
from starsd.gather import Returns

log = logging.getLogger("edge.batcher")

_FORWARD_SMOOTHING = 0.2  # weight of the newest decoding forward in the gathering window

PREFILL, STEP, VERIFY = "prefill", "step", "verify"


@dataclass
class WorkItem:
    """One sequence's request to the model thread."""

    kind: str  # PREFILL, STEP or VERIFY
    seq: TargetSequence
    future: asyncio.Future[Any]
    drafts: Sequence[int] = ()
    q_probs: torch.Tensor | None = None  # [gamma, V] for a sampled VERIFY
    parents: verifier.Parents = None  # a VERIFY of a token tree (None: the drafts are a chain)

    @property
    def group(self) -> str:
        """Items of one group share a forward: prefills apart from decoding rows."""
        return PREFILL if self.kind == PREFILL else VERIFY


@dataclass(frozen=True)
class ForwardMark:
    """A sequence's forward clocks read at one moment (:meth:`Batcher.mark`)."""

    busy_s: float  # Batcher.busy_clock()
    own_s: float  # seconds of the forwards that carried the sequence (its stats)
    own_forwards: int  # and how many


@dataclass
class BatchStats:
    """How full the forwards were."""

    forwards: int = 0
    rows: int = 0
    max_rows: int = 0
    rows_by_kind: dict[str, int] = field(default_factory=dict)

    def record(self, kinds: Sequence[str]) -> None:
        """One forward of rows of these kinds (nothing when no row needed a forward)."""
        if not kinds:
            return
        self.forwards += 1
        self.rows += len(kinds)
        self.max_rows = max(self.max_rows, len(kinds))
        for kind in kinds:
            self.rows_by_kind[kind] = self.rows_by_kind.get(kind, 0) + 1

    @property
    def mean_rows(self) -> float:
        """Mean rows per forward (1.0 when nothing batched)."""
        return self.rows / self.forwards if self.forwards else 0.0


class Batcher:
    """The target's model thread, shared by all its sequences (see the module docstring)."""

    def __init__(
        self,
        backend: VerifierBackend,
        max_batch: int = 32,
        pool: ThreadPoolExecutor | None = None,
        stats: BatchStats | None = None,
        gather: bool = True,
    ) -> None:
        """``pool``: the model thread (default: one of our own, shut down by :meth:`aclose`);
        ``stats``: where to count forwards and rows (default: a fresh one); ``gather``: wait
        for the sequences whose next item is due within one forward's time."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.backend = backend
        self.max_batch = max_batch
        self._own_pool = pool is None
        self._pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        self._pending: list[WorkItem] = []
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._watchers: dict[int, Callable[[TargetSequence], None]] = {}
        self.stats = stats if stats is not None else BatchStats()
        self._full_logged = False  # the first full batch is worth an INFO line, not every one
        # event loop's own: when each sequence's next item is due (its hub round trip)
        self.returns = Returns() if gather and max_batch > 1 else None
        self.forward_s = 0.0  # smoothed time of a decoding forward: the gathering window
        self._busy_s = 0.0  # seconds of forwards finished (see busy_clock)
        self._busy_from: float | None = None  # when the forward running now began

    # ------------------------------------------------------------------ what sequences call

    async def prefill(self, seq: TargetSequence) -> None:
        """Feed the prompt (but its last token) into the sequence's cache."""
        await self._submit(WorkItem(PREFILL, seq, self._future()))

    async def step(self, seq: TargetSequence) -> int:
        """One token from the target alone; returns it."""
        token: int = await self._submit(WorkItem(STEP, seq, self._future()))
        return token

    async def verify(
        self,
        seq: TargetSequence,
        drafts: Sequence[int],
        q_probs: torch.Tensor | None,
        parents: verifier.Parents = None,
    ) -> tuple[int, list[int]]:
        """Verify a proposal (``parents``: a token tree's) and commit; (accepted, appended) as
        :func:`verifier.verify_batch` (accepted: the length of a tree's accepted path).

        Raises ValueError for a proposal the verifier refuses (other rows are unaffected).
        """
        result: tuple[int, list[int]] = await self._submit(
            WorkItem(VERIFY, seq, self._future(), drafts, q_probs, parents)
        )
        return result

    def busy_clock(self) -> float:
        """Seconds the model thread has spent on forwards so far, the one running now included
        (a sequence that arrives mid-forward waits out the rest of it). Event loop's own."""
        running = 0.0 if self._busy_from is None else time.perf_counter() - self._busy_from
        return self._busy_s + running

    def mark(self, seq: TargetSequence) -> ForwardMark:
        """``seq``'s forward clocks now, for :meth:`forwards_since`."""
        return ForwardMark(self.busy_clock(), seq.stats.forward_s, seq.stats.forwards)

    def forwards_since(self, seq: TargetSequence, mark: ForwardMark) -> tuple[float, float]:
        """(others, own) since ``mark``: the seconds the model spent on forwards that did not
        carry ``seq`` (other sequences' prompts, and rows not batched with it), and the mean
        seconds of those that did (0.0: none). What a DRAFT reports (Draft.others_us,
        forward_us)."""
        own_s = seq.stats.forward_s - mark.own_s
        count = seq.stats.forwards - mark.own_forwards
        others = max(self.busy_clock() - mark.busy_s - own_s, 0.0)
        return others, own_s / count if count > 0 else 0.0

    def watch(self, seq: TargetSequence, callback: Callable[[TargetSequence], None]) -> None:
        """Call ``callback(seq)`` on the event loop after each item of ``seq`` completes, until
        :meth:`release`. A server streams the tokens committed since the last call from it."""
        self._watchers[id(seq)] = callback

    def release(self, seq: TargetSequence) -> None:
        """``seq`` ended or was cancelled: no more callbacks, and no proposal of its is waited
        for (a cancelled request's proposal never comes: each forward due to wait for it would
        wait the whole window)."""
        self._watchers.pop(id(seq), None)
        if self.returns is not None:
            self.returns.forget(id(seq))

    async def aclose(self) -> None:
        """Stop the worker (pending items are cancelled) and the model thread if ours."""
        if self._worker is not None:  # (its gathering wait_for can drop a cancel)
            await transport.cancel_and_wait([self._worker])
            self._worker = None
        for item in self._pending:
            item.future.cancel()
        self._pending.clear()
        if self._own_pool:  # waits out a forward still running, off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown)

    async def __aenter__(self) -> Batcher:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ the worker

    def _future(self) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()

    async def _submit(self, item: WorkItem) -> Any:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work(), name="batcher")
        if self.returns is not None:
            self.returns.arrived(id(item.seq), time.perf_counter())
        self._pending.append(item)
        self._wake.set()
        return await item.future

    async def _work(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._gather()
                batch = self._take()
                if batch:
                    await self._run(batch)
                    # Let the sequences just answered queue their next items first: else a
                    # sequence that joined out of step (a new one after a prefill) stays out
                    # of step, its forwards alternating with its batch mates' for good.
                    await asyncio.sleep(0)

    def _timed(self, took: float) -> None:
        """A decoding forward took ``took`` seconds: the gathering window follows it."""
        weight = _FORWARD_SMOOTHING if self.forward_s else 1.0
        self.forward_s += weight * (took - self.forward_s)

    async def _gather(self) -> None:
        """Before a decoding forward, wait (at most one forward's time, which the wait saves)
        for the sequences whose proposals are due by then: one forward for all of them instead
        of two in turn (see :mod:`starsd.gather`).

        A proposal due when the wait starts is waited for until it arrives or the window ends,
        however late it runs against its round trip: a hub round trip spreads by more than a
        quarter of itself (at --concurrency 8, 1 in 10 proposals came 4.4 ms or more after
        their ~13 ms R), and a forward started without one costs its sequence that whole
        forward, after which its batch mates and it take turns.
        """
        if self.returns is None or self.forward_s <= 0 or self._pending[0].group == PREFILL:
            return
        started = time.perf_counter()
        deadline = started + self.forward_s
        awaited = set(self.returns.expected(started, self.forward_s))
        while awaited and len(self._pending) < self.max_batch:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), deadline - time.perf_counter())
            except asyncio.TimeoutError:
                return
            awaited = {tag for tag in awaited if self.returns.out(tag)}

    def _take(self) -> list[WorkItem]:
        """Up to ``max_batch`` pending items of the oldest item's group, in arrival order
        (cancelled ones dropped); the rest stay pending."""
        self._pending = [i for i in self._pending if not i.future.done()]
        if not self._pending:
            return []
        group = self._pending[0].group
        batch = [i for i in self._pending if i.group == group][: self.max_batch]
        taken = {id(i) for i in batch}
        self._pending = [i for i in self._pending if id(i) not in taken]
        return batch

    async def _run(self, batch: list[WorkItem]) -> None:
        """One forward in the model thread; every item's future gets its result or error."""
        prefill = batch[0].group == PREFILL
        results, kinds, started, finished = await self._forward(batch)
        if not prefill and kinds:
            self._timed(finished - started)
        self.stats.record(kinds)
        if len(kinds) == self.max_batch and not self._full_logged:
            self._full_logged = True
            log.info(
                "a forward took --max-batch %d rows: more sequences wait for the next one",
                self.max_batch,
            )
        for item, result in zip(batch, results, strict=True):
            if not prefill and not isinstance(result, BaseException):  # a forward carried it
                item.seq.stats.forwards += 1
                item.seq.stats.forward_s += finished - started
            if self.returns is not None and item.kind == VERIFY and not item.seq.done:
                self.returns.sent(id(item.seq), finished)  # its DRAFT goes out now
            if not item.future.done():
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)
            watcher = self._watchers.get(id(item.seq))
            if watcher is not None:
                try:
                    watcher(item.seq)
                except Exception:  # a listener's bug must not stop the worker (all would hang)
                    log.exception("a watcher of a sequence failed")

    async def _forward(self, batch: list[WorkItem]) -> tuple[list[Any], list[str], float, float]:
        """Run ``batch`` in the model thread: (results, row kinds, started, finished); its time
        runs on :meth:`busy_clock` meanwhile."""
        loop = asyncio.get_running_loop()
        started = self._busy_from = time.perf_counter()
        try:
            results, kinds = await loop.run_in_executor(self._pool, compute, self.backend, batch)
        except Exception as exc:  # the forward itself failed: this batch hears it, not others
            log.error("batched forward of %d rows failed: %r", len(batch), exc)
            results, kinds = [exc] * len(batch), []
        finally:
            finished, self._busy_from = time.perf_counter(), None
            self._busy_s += finished - started
        return results, kinds, started, finished


def compute(backend: VerifierBackend, batch: Sequence[WorkItem]) -> tuple[list[Any], list[str]]:
    """Run one group of items as one forward (model thread): each item's result (a row the
    verifier refuses gets its ValueError; the other rows still run) and the kinds of the rows
    that went into the forward."""
    results: list[Any] = [None] * len(batch)
    rows = []
    for n, item in enumerate(batch):
        try:
            if item.kind != PREFILL:
                verifier.check_proposal(item.seq, item.drafts, item.q_probs, item.parents)
            rows.append(n)
        except ValueError as exc:
            results[n] = exc
    if rows and batch[rows[0]].kind == PREFILL:
        fed = verifier.prefill_batch(backend, [batch[n].seq for n in rows])
        return results, [PREFILL] * fed
    if rows:
        proposals = [(batch[n].seq, batch[n].drafts, batch[n].q_probs) for n in rows]
        rounds = [batch[n].kind == VERIFY for n in rows]
        shapes = [batch[n].parents for n in rows]
        done = verifier.decode_batch(backend, proposals, rounds, shapes)
        for n, (accepted, appended) in zip(rows, done, strict=True):
            results[n] = appended[0] if batch[n].kind == STEP else (accepted, appended)
    return results, [batch[n].kind for n in rows]
