"""Requests of the HTTP server as sequences in flight: admission, decoding, streamed text.

:class:`RequestQueue` admits requests (429 past ``--max-queue``), holds ``--concurrency``
decoding slots and drains on shutdown; :class:`Generation` is one admitted request.

Each admitted request becomes a task that waits for one of ``concurrency`` slots, builds its
sequence with :func:`edge.target.new_sequence` and runs it with :meth:`edge.engine.Engine.run`,
the one run path ``--prompts`` takes too (every forward, the prefill too, batched with the other
requests' by :class:`edge.batcher.Batcher`, built from the same options): the hub proposes where
it is up, the target decodes alone where it is not. The sequence's
``on_commit`` hook (called in the worker thread) posts each run of committed tokens to the
request's queue on the event loop; :meth:`Generation.events` turns them into stable text deltas
(:mod:`edge.textstream`), applies ``stop`` strings and records the metrics.

Cancelling a generation (a client that went away, a stop string) cancels its task:
the run path then closes its hub session on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from edge import engine, speculate
from edge.backends.base import VerifierBackend
from edge.batcher import Batcher
from edge.hubs import HubPool
from edge.metrics import TargetMetrics
from edge.textstream import TextStream
from edge.verifier import TargetSequence
from starsd.protocol import SamplingParams

log = logging.getLogger("edge.serve")


class ServeConfig(Protocol):
    """What the server reads of ``edge.target_config.TargetConfig`` (a protocol: any config with
    these fields serves, the tests' included)."""

    @property
    def concurrency(self) -> int: ...
    @property
    def max_queue(self) -> int: ...
    @property
    def gamma(self) -> int: ...
    @property
    def fallback(self) -> speculate.Fallback: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def gather(self) -> bool: ...


@dataclass(frozen=True)
class Job:
    """One request, validated: what to decode and when to stop."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stops: tuple[str, ...] = ()


@dataclass(frozen=True)
class Delta:
    """Text that became final; the last one has ``finish`` ("stop" or "length") and totals."""

    text: str
    finish: str | None = None
    completion_tokens: int = 0
    figures: dict[str, Any] | None = None


# A request's sequence from (job, request index, feature taps): edge.target.job_sequence,
# the construction --prompts uses.
NewSequence = Callable[["Job", int, tuple[int, ...]], TargetSequence]

# What the worker thread posts per commit: the tokens, and the sequence's running totals of
# rounds, draft tokens and accepted tokens then (a round's figures are the difference).
_Commit = tuple[list[int], int, int, int]


class RequestQueue:
    """Admission and the decoding slots of the server's requests, over the one run path
    (:class:`edge.engine.Engine`) and its batcher (the model thread) that every request shares."""

    def __init__(
        self,
        config: ServeConfig,
        target: VerifierBackend,
        metrics: TargetMetrics,
        client: HubPool | None,
        new_sequence: NewSequence,
    ) -> None:
        self.config = config
        self.target = target
        self.new_sequence = new_sequence
        self.metrics = metrics
        self.client = client  # None: --standalone
        # the one model thread: every request's forwards batched (edge.batcher)
        self.batcher = Batcher(target, config.max_batch, gather=config.gather)
        self.runner = engine.Engine(target, self.batcher, client, config.gamma, config.fallback)
        self.slots = asyncio.Semaphore(config.concurrency)
        self.running = 0
        self.waiting = 0
        self.index = itertools.count()
        self.tasks: set[asyncio.Task[None]] = set()
        self.live: set[Generation] = set()  # admitted and not finished (drain ends them)
        self.draining = False  # shutting down: nothing new is admitted

    @property
    def admitted(self) -> int:
        """Requests running or waiting for a slot."""
        return self.running + self.waiting

    def full(self) -> bool:
        return self.admitted >= self.config.max_queue

    def start(self, job: Job) -> Generation:
        """Admit ``job`` now (its decoding task starts at once); see :meth:`full` first."""
        generation = Generation(self, job)
        self.metrics.prompt_tokens.labels(**self.metrics.labels).inc(len(job.prompt_ids))
        self.waiting += 1
        self.publish()
        task = asyncio.create_task(self._decode(generation))
        self.tasks.add(task)  # a reference until it ends, also after its client went away
        task.add_done_callback(self.tasks.discard)
        self.live.add(generation)
        task.add_done_callback(lambda _: self.live.discard(generation))
        generation.task = task
        return generation

    async def _decode(self, generation: Generation) -> None:
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        generation.started = True
        self.running += 1
        self.publish()
        try:
            await self._run(generation)
            generation.commits.put_nowait(None)
        except asyncio.CancelledError:  # Generation.cancel, or the server stopping
            raise
        except Exception as exc:  # a bug or a broken model: this request fails, not the server
            log.exception("request failed")
            generation.commits.put_nowait(exc)
        finally:
            self.running -= 1
            self.slots.release()
            self.publish()

    async def _run(self, generation: Generation) -> None:
        loop = asyncio.get_running_loop()
        seq = self._new_sequence(generation.job)  # no model work: the prefill is batched
        generation.seq = seq
        seq.on_commit = generation.hook(loop)
        await self.runner.run(seq)

    def _new_sequence(self, job: Job) -> TargetSequence:
        return self.new_sequence(job, next(self.index), self.runner.feature_taps())

    def publish(self) -> None:
        """Refresh the running / waiting / hub gauges."""
        live = len(self.client.live()) if self.client is not None else 0
        self.metrics.set_queue(self.running, self.waiting, live)

    async def drain(self, grace_s: float, why: Exception) -> int:
        """Shut down gracefully: admit nothing more, end the requests still waiting for a slot
        at once and give the running ones ``grace_s`` to finish; those that cannot are ended
        too. An ended request's stream gets ``why`` as its last event (then ``[DONE]``), so no
        client mistakes cut text for a complete answer. Returns how many were ended."""
        self.draining = True
        ended = [g for g in list(self.live) if not g.started]
        deadline = time.monotonic() + grace_s
        for generation in ended:
            generation.fail(why)
        while any(g.started for g in self.live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        late = list(self.live)
        for generation in late:
            generation.fail(why)
        return len(ended) + len(late)

    async def aclose(self) -> None:
        """Cancel what is still decoding (closing its hub sessions), stop the worker."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.batcher.aclose()


class Generation:
    """One admitted request: its decoding task and the committed tokens it streams."""

    def __init__(self, requests: RequestQueue, job: Job) -> None:
        self.requests = requests
        self.job = job
        self.arrived = time.perf_counter()
        self.commits: asyncio.Queue[_Commit | Exception | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.seq: TargetSequence | None = None
        self.answered = False  # its final delta was produced (finished, or ended by a stop)
        self.cancelled = False
        self.started = False  # it holds a decoding slot

    def hook(self, loop: asyncio.AbstractEventLoop) -> Any:
        """The sequence's on_commit: runs in the worker thread, posts to the event loop."""

        def on_commit(tokens: list[int]) -> None:
            assert self.seq is not None
            stats = self.seq.stats
            item = (list(tokens), stats.rounds, stats.proposed, stats.accepted)
            with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone
                loop.call_soon_threadsafe(self.commits.put_nowait, item)

        return on_commit

    def cancel(self) -> None:
        """Stop decoding (idempotent); the hub session is closed by the decoding task. Counted
        as an abort unless the request was answered (a stop string ends decoding this way)."""
        if self.task is None or self.task.done() or self.cancelled:
            return
        self.cancelled = True
        if not self.answered:
            self.requests.metrics.record_abort()
        if self.seq is not None:
            # Also end the loop in generate_speculative: Python 3.11's asyncio.wait_for returns
            # a result that was ready when the cancel came and drops the cancel, so a cancel
            # alone can be lost. The worker thread never reads ``done``; the hub session is
            # closed on the way out either way.
            self.seq.done = True
        self.task.cancel()

    def fail(self, why: Exception) -> None:
        """End the request with ``why`` (its consumer raises it after the text so far) and stop
        its decoding; not counted as an abort (the server ended it, not the client)."""
        if self.answered or self.cancelled:
            return
        self.commits.put_nowait(why)
        self.cancelled = True
        if self.seq is not None:
            self.seq.done = True
        if self.task is not None:
            self.task.cancel()

    async def events(self) -> AsyncIterator[Delta]:
        """Text deltas as tokens commit, the last with its finish reason; cancels the decoding
        if the consumer stops early (a disconnect, a stop string)."""
        try:
            async for delta in self._events():
                yield delta
        finally:
            self.cancel()

    async def _events(self) -> AsyncIterator[Delta]:
        m = self.requests.metrics
        text = TextStream(self.requests.target.decode, self.job.stops)
        last, seen, totals = self.arrived, 0, (0, 0, 0)
        while (item := await self.commits.get()) is not None:
            if isinstance(item, Exception):
                raise item
            tokens, *now = item
            if now[0] > totals[0]:  # this commit ends a verified round
                m.record_round(now[1] - totals[1], now[2] - totals[2])
            totals = (now[0], now[1], now[2])
            clock = time.perf_counter()
            m.record_tokens(len(tokens), clock - last, first=seen == 0)
            last, seen = clock, seen + len(tokens)
            piece = text.push(tokens)
            if piece:
                yield Delta(piece)
            if text.stopped:
                break
        rest = text.finish()
        yield self._final(rest, text.stopped, seen)

    def _final(self, text: str, stopped: bool, tokens: int) -> Delta:
        seq = self.seq
        assert seq is not None
        eos = bool(seq.generated[:tokens]) and seq.generated[tokens - 1] in seq.info.eos_token_ids
        finish = "stop" if stopped or eos else "length"
        self.answered = True
        stats = seq.stats
        figures = {**stats.as_dict(tokens), "proposed": stats.proposed}
        self.requests.metrics.record_finish(
            finish, time.perf_counter() - self.arrived, stats.standalone_steps, stats.alone_steps
        )
        return Delta(text, finish, tokens, figures)
