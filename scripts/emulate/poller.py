"""Emulated targets on one ZeroMQ poller: the same sequences, rounds and report as the asyncio
driver (:mod:`scripts.emulate.emulated`), at a fraction of its CPU per round.

One process stands in for all N targets and handles their messages one after another, so its
CPU per message delays the last target of every batch: the last of B proposals starts its
verify (B - 1) messages' handling late, and the hub's next batch waits for it. Real targets,
each on its own machine, do not queue so: the load generator's serial cost is an artefact of
the emulation, and it must stay small beside a round. The asyncio driver runs the target's own
hub client (zmq.asyncio futures, a task and a queue per session) at about 0.16 ms of CPU a
round; this driver keeps every target's DEALER socket in one ``zmq.Poller``, reads with
NOBLOCK, and holds each verify as a deadline in one heap, for about 0.06 ms of handling a round
(``emulator_cpu_fraction`` in the report says what a run spent).

One hub only: placing sessions over several hubs is the target's :class:`edge.hubs.HubPool`
(asyncio), which the asyncio driver runs. Owned by one thread: no lock.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from edge.handshake import TargetInfo
from scripts.emulate.config import EmulationConfig, Phases, schedule, switch_time
from scripts.emulate.report import TargetRecord, full_report
from scripts.emulate.rounds import Answer, SequenceRounds, new_trace
from starsd import protocol
from starsd.protocol import (
    Close,
    Draft,
    Error,
    Hello,
    Open,
    Opened,
    Ping,
    Pong,
    Proposal,
    SamplingParams,
    Stats,
    StatsRequest,
    Welcome,
)

PROMPT_TOKENS = 16
WELCOME_TIMEOUT_MS = 10_000
WARMUP_LIMIT_S = 60.0
IDLE_POLL_MS = 10  # the longest a poll waits with no deadline due
# zmq_poll counts whole milliseconds; the last one before a deadline is waited in naps this
# long (a message arriving then is read at most this late)
NAP_S = 0.0002
CLOSE_FLUSH_S = 0.2


@dataclass
class PolledTarget:
    """One emulated target: its connection and the sequence it has in flight."""

    index: int
    sock: zmq.Socket
    rng: random.Random
    record: TargetRecord = field(default_factory=TargetRecord)
    tag: bytes = b""  # the open session's (b"": an OPEN is out)
    rounds: SequenceRounds | None = None


class PolledEmulation:
    """N emulated targets against one hub, driven by one poller (see the module docstring)."""

    def __init__(self, cfg: EmulationConfig, info: TargetInfo) -> None:
        if len(cfg.endpoints) != 1:
            raise ValueError("the poller drives one hub; several hubs: the asyncio driver")
        self.cfg, self.info = cfg, info
        self.endpoint = cfg.endpoints[0]
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.phases = Phases()
        self.targets: dict[zmq.Socket, PolledTarget] = {}
        self.due: list[tuple[float, int, PolledTarget, Answer]] = []  # verifies, by deadline
        self._order = itertools.count()  # ties in the heap: first in, first out
        self.snapshots: list[Stats] = []
        self.cpu: list[tuple[float, float]] = []
        # this process's serial cost: seconds spent handling messages (turns that found
        # nothing to do not counted), and the verdicts sent meanwhile
        self.busy_s, self.verdicts = 0.0, 0
        self.stale = 0  # messages of closed sessions, dropped

    # ------------------------------------------------------------------ connections

    def connect(self) -> None:
        """One DEALER per target, each welcomed (HELLO/WELCOME) before the run starts."""
        hello = Hello(
            self.info.model,
            self.info.vocab_size,
            self.info.tokenizer,
            tree_nodes=self.info.tree_nodes,
        )
        for index in range(self.cfg.targets):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            sock.send_multipart(protocol.encode(hello))
            if not sock.poll(WELCOME_TIMEOUT_MS):
                raise RuntimeError(f"target {index}: no WELCOME from {self.endpoint}")
            welcome = protocol.decode(sock.recv_multipart())
            if not isinstance(welcome, Welcome):
                raise RuntimeError(f"target {index}: the hub refused HELLO: {welcome}")
            rng = random.Random(self.cfg.seed * 100_003 + index)
            self.targets[sock] = PolledTarget(index, sock, rng)
            self.poller.register(sock, zmq.POLLIN)

    def close(self) -> None:
        """CLOSE every open session (so the hub drops its queued jobs), then the sockets."""
        for target in self.targets.values():
            if target.tag:
                self._send(target, Close(target.tag))
        time.sleep(CLOSE_FLUSH_S)  # linger 0: let the CLOSEs out first
        self.ctx.destroy(linger=0)  # every socket, a refused target's too

    def _send(self, target: PolledTarget, msg: protocol.Message) -> None:
        target.sock.send_multipart(protocol.encode(msg))

    def _open(self, target: PolledTarget) -> None:
        prompt = [target.rng.randrange(self.info.vocab_size) for _ in range(PROMPT_TOKENS)]
        target.tag, target.rounds = b"", None
        target.record.placed[self.endpoint] = target.record.placed.get(self.endpoint, 0) + 1
        ids = np.asarray(prompt, dtype=np.int32)
        self._send(target, Open(target.index, ids, SamplingParams(), self.cfg.gamma))

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        """Open every target's first sequence, warm up, then run the slices to the end."""
        for target in self.targets.values():
            self._open(target)
        self._warm_up()
        bounds = self.phases.bounds
        for i, bound in enumerate(bounds):
            self._turn_until(bound)
            self._send(next(iter(self.targets.values())), StatsRequest(i))
            self._turn_until(None, stats=i + 1)

    def _warm_up(self) -> None:
        started = time.perf_counter()
        while self.phases.first_proposals < self.cfg.targets or (
            time.perf_counter() - started < self.cfg.warmup
        ):
            if time.perf_counter() - started > self.cfg.warmup + WARMUP_LIMIT_S:
                raise RuntimeError(
                    f"{self.phases.first_proposals} of {self.cfg.targets} targets had a "
                    f"proposal after {WARMUP_LIMIT_S:.0f} s"
                )
            self._turn(time.perf_counter() + IDLE_POLL_MS / 1e3)
        self.phases.bounds = schedule(time.perf_counter(), self.cfg)
        self.phases.switch = switch_time(self.phases.bounds, self.cfg)

    def _turn_until(self, until: float | None, stats: int = 0) -> None:
        """Turn until ``until`` (perf_counter), or until ``stats`` snapshots have come back."""
        while (time.perf_counter() < until) if until is not None else len(self.snapshots) < stats:
            self._turn(until)

    def _turn(self, until: float | None) -> None:
        """Send every verdict now due, then read what arrives before the next deadline."""
        now = time.perf_counter()
        if self.due and self.due[0][0] <= now:
            while self.due and self.due[0][0] <= now:
                _, _, target, ans = heapq.heappop(self.due)
                self._settle(target, ans)
            self.busy_s += time.perf_counter() - now
        deadlines = [d for d in (self.due[0][0] if self.due else None, until) if d is not None]
        wait_s = min([IDLE_POLL_MS / 1e3] + [max(0.0, d - now) for d in deadlines])
        ready = self.poller.poll(int(wait_s * 1e3))  # (whole milliseconds: zmq_poll's unit)
        if not ready:
            if wait_s < 1e-3:  # under a millisecond to go: nap in short slices
                time.sleep(min(wait_s, NAP_S))
            return
        woke = time.perf_counter()
        for sock, _ in ready:
            self._read(self.targets[sock])
        self.busy_s += time.perf_counter() - woke

    def _read(self, target: PolledTarget) -> None:
        while True:
            try:
                frames = target.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(target, protocol.decode(frames), sum(len(f) for f in frames))

    def _dispatch(self, target: PolledTarget, msg: protocol.Message, size: int) -> None:
        if isinstance(msg, Ping):
            self._send(target, Pong(msg.nonce))
        elif isinstance(msg, Stats):
            self.snapshots.append(msg)
            self.cpu.append((time.perf_counter(), time.process_time()))
        elif self._stale(target, msg):
            self.stale += 1
        elif isinstance(msg, Opened):
            self._opened(target, msg)
        elif target.rounds is None:
            raise RuntimeError(f"target {target.index}: {msg} before OPENED")
        else:
            self._take(target, msg, size)

    @staticmethod
    def _stale(target: PolledTarget, msg: protocol.Message) -> bool:
        """Whether ``msg`` belongs to a session this target has closed: the hub may answer a
        sequence's last DRAFT before it reads the CLOSE sent right after it."""
        tag = msg.tag if isinstance(msg, Proposal | Error) else None
        return tag is not None and tag != target.tag

    def _opened(self, target: PolledTarget, msg: Opened) -> None:
        target.tag = msg.tag
        trace = new_trace(target.index, self.phases) if self.cfg.tracing else None
        if trace is not None:
            target.record.traces.append(trace)
        target.rounds = SequenceRounds(
            self.cfg, target.rng, self.info.vocab_size, self.phases, target.record,
            self.endpoint, trace,
        )  # fmt: skip

    def _take(self, target: PolledTarget, msg: protocol.Message, size: int) -> None:
        assert target.rounds is not None  # (checked by _dispatch)
        ans = target.rounds.take(msg, size)
        if ans is None:  # the sequence ends here: a new one opens
            self._next_sequence(target)
            return
        deadline = target.rounds.received + ans.wait_s
        heapq.heappush(self.due, (deadline, next(self._order), target, ans))

    def _settle(self, target: PolledTarget, ans: Answer) -> None:
        rounds = target.rounds
        assert rounds is not None  # (a verify is due only for a sequence in flight)
        seq = rounds.settle(ans)
        self.verdicts += 1
        path = None if ans.path is None else np.asarray(ans.path, dtype=np.int32)
        appended = np.asarray(ans.appended, dtype=np.int32)
        forward_us = protocol.timing_us(ans.forward_s)  # as a real target reports its forwards
        self._send(
            target, Draft(target.tag, seq, ans.accepted, appended, path=path, forward_us=forward_us)
        )
        if not rounds.wants_more():
            self._next_sequence(target)

    def _next_sequence(self, target: PolledTarget) -> None:
        if target.tag:
            self._send(target, Close(target.tag))
        if time.perf_counter() < self.phases.finish:
            self._open(target)
        else:
            target.tag, target.rounds = b"", None

    def report(self) -> dict:
        """The run's report (:func:`scripts.emulate.report.full_report`)."""
        records = [t.record for t in self.targets.values()]
        serial_ms = 1e3 * self.busy_s / max(self.verdicts, 1)
        return full_report(self.cfg, records, [self.snapshots], self.cpu, serial_ms)


def emulate_polled(cfg: EmulationConfig, info: TargetInfo) -> dict:
    """Run the emulation on one poller and return its report."""
    emulation = PolledEmulation(cfg, info)
    try:
        emulation.connect()
        emulation.run()
    finally:
        emulation.close()
    return emulation.report()
