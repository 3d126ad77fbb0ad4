"""The StarSD draft hub: one ROUTER socket, many targets, one work-conserving drafting thread.

    python -m starsd.hub --model DIR --bind tcp://127.0.0.1:5555 [--gamma 4] [--device cuda]
    python -m starsd.hub --bind tcp://*:5555 --curve-secret hub.key_secret --allow-dir targets/

The event loop reads the socket and handles every message; it never runs the model. Draft
requests go into the global queue Q_in (fair across targets, see :mod:`starsd.scheduler`); the
drafting thread takes every pending request, calls ``Drafter.propose`` and delivers the results
itself: it updates the sessions and sends each proposal with a NOBLOCK send, so Q_out is the
ROUTER's per-target outgoing queues, which the ZeroMQ I/O thread drains while the next batch
is drafted. The drafter therefore works whenever any target has work pending and never waits
for one target's verdict or for the network. Protocol state (peers, sessions, sequence numbers,
leases) is shared by the two threads under one lock, held only for bookkeeping, never across
model work.

Faults: any message renews its target's lease; a target silent for 3 heartbeat intervals loses
its sessions and draft state. Every reply carries the hub's random epoch, so a target notices a
restarted hub and re-opens its sessions from its own committed tokens. SIGTERM drains: no new
sessions, in-flight rounds are delivered, every target is told SHUTTING_DOWN, exit 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq.asyncio

from starsd import protocol
from starsd.auth import (
    AllowList,
    CurveAuthenticator,
    CurveServerConfig,
    check_plaintext_endpoint,
    start_authenticator,
)
from starsd.drafter import Drafter, DraftJob, DraftState
from starsd.protocol import (
    Close,
    Draft,
    Error,
    ErrorCode,
    Hello,
    Open,
    Opened,
    Ping,
    Pong,
    Proposal,
    ProtocolError,
    Stats,
    StatsRequest,
    Welcome,
)
from starsd.router import Received, Router, bind_router
from starsd.scheduler import FairQueue
from starsd.stats import HubStats, TargetStats

log = logging.getLogger("starsd.hub")

LEASE_INTERVALS = 3  # a target silent for this many heartbeat intervals is presumed dead


@dataclass(frozen=True)
class HubConfig:
    """Everything ``python -m starsd.hub`` is told."""

    model: str
    bind: str = "tcp://127.0.0.1:5555"
    gamma: int = 4
    max_gamma: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    max_sessions: int = 256
    max_sessions_per_target: int = 64
    max_batch: int = 64
    threads: int = 1
    stats_interval: float = 10.0
    draft_kind: str = "llm"
    target: str | None = None  # EAGLE: the target's directory (embedding, LM head, tokenizer)
    heartbeat_s: float = 1.0
    drain_timeout_s: float = 5.0
    curve_secret: str | None = None
    allow_dir: str | None = None
    insecure: bool = False  # allow plain text on a non-loopback bind

    @property
    def curve(self) -> CurveServerConfig | None:
        if self.curve_secret is None or self.allow_dir is None:
            return None
        return CurveServerConfig(Path(self.curve_secret), Path(self.allow_dir))


@dataclass
class Peer:
    """One welcomed target connection and what sessions are bound to."""

    routing_id: bytes
    key: bytes  # the CURVE public key when authenticated, else the routing id
    stats: TargetStats
    last_seen: float = field(default_factory=time.monotonic)
    tags: set[bytes] = field(default_factory=set)


@dataclass
class Session:
    """Protocol state of one sequence; ``state`` belongs to the drafting thread."""

    tag: bytes
    owner: bytes  # Peer.key of the target that opened it
    routing_id: bytes  # where its proposals go (the owner's current connection)
    state: DraftState
    next_seq: int = 0
    in_flight: bool = False
    last_gamma: int = 0  # tokens in the proposal the next verdict refers to


class Hub:
    """Protocol dispatcher plus the drafting thread; see the module docstring."""

    def __init__(self, config: HubConfig, drafter: Drafter, welcome: Welcome) -> None:
        self.config = config
        self.drafter = drafter
        self.welcome = welcome
        self.epoch = welcome.epoch
        self.vocab_size = welcome.vocab_size
        self.max_positions = drafter.max_positions
        self.peers: dict[bytes, Peer] = {}  # by routing id
        self.sessions: dict[bytes, Session] = {}
        self.stats = HubStats()
        self.lock = threading.Lock()  # peers, sessions and their counters: loop vs drafting thread
        self.q_in: FairQueue[DraftJob] = FairQueue()
        self.router: Router | None = None  # set while serving
        self.stopping = asyncio.Event()
        self.draining = False
        self.allow: AllowList | None = None
        self.endpoint = ""

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, ctx: zmq.asyncio.Context) -> None:
        """Bind, run until ``stop()``, drain, then shut down cleanly and log the summary."""
        auth = self._start_security(ctx)
        self.router = sock = bind_router(ctx, self.config.bind, self.config.curve,
                                         int(1000 * self.config.heartbeat_s))  # fmt: skip
        self.endpoint = sock.endpoint
        worker = threading.Thread(target=self._drafting_loop, name="drafter")
        worker.start()
        self._log_start()
        sock.start(self._on_messages)
        tasks = [asyncio.create_task(c) for c in (self._stats_loop(), self._lease_loop())]
        try:
            await self.stopping.wait()
            await self._drain()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.q_in.close()
            await asyncio.to_thread(worker.join)
            sock.close()
            if auth is not None:
                auth.stop()
            self._log_summary()

    def stop(self) -> None:
        """Ask ``serve`` to drain and finish (safe from signal handlers on the loop)."""
        self.stopping.set()

    def _start_security(self, ctx: zmq.asyncio.Context) -> CurveAuthenticator | None:
        curve = self.config.curve
        if curve is None:
            check_plaintext_endpoint(self.config.bind,
                                     allow_insecure=self.config.insecure)  # fmt: skip
            return None
        self.allow = AllowList(curve.allow_dir)
        return start_authenticator(ctx, self.allow)

    def _log_start(self) -> None:
        mode = (f"CURVE, {len(self.allow)} allowed target keys" if self.allow is not None
                else "plain text, NOT encrypted or authenticated")  # fmt: skip
        log.info("hub listening on %s (%s; draft %s, epoch %s)", self.endpoint, mode,
                 self.welcome.model, self.epoch.hex())  # fmt: skip

    async def _drain(self) -> None:
        """Admit nothing new, deliver what is in flight, then tell every target we are going."""
        with self.lock:
            self.draining = True
        log.info("draining: %d rounds in flight, %d sessions, timeout %.1f s", self._in_flight(),
                 len(self.sessions), self.config.drain_timeout_s)  # fmt: skip
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self._in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with self.lock:
            for peer in self.peers.values():
                self._send(peer.routing_id, Error(ErrorCode.SHUTTING_DOWN, "hub is stopping"))
        await asyncio.sleep(0.05)  # let the I/O thread flush the notices (LINGER is 0)

    def _in_flight(self) -> int:
        with self.lock:
            return sum(s.in_flight for s in self.sessions.values())

    # ------------------------------------------------------------------ drafting thread

    def _drafting_loop(self) -> None:
        limit = min(self.config.max_batch, self.drafter.batch_size)
        while (batch := self.q_in.take(limit)) is not None:
            started, cpu_started = time.perf_counter(), time.thread_time()
            self.stats.batch_started = started
            results = self.drafter.propose(batch)
            with self.lock:  # delivering here spares each round a wake-up of the event loop
                self._deliver_batch(batch, results, started)
            # Busy time is the whole service of the batch, delivery included: S(d) of the model.
            self.stats.batch_started = None
            self.stats.busy_s += time.perf_counter() - started
            self.stats.busy_cpu_s += time.thread_time() - cpu_started
            self.stats.batches += 1
            self.stats.jobs += len(batch)

    # ------------------------------------------------------------------ event loop

    def _on_messages(self, received_batch: list[Received]) -> None:
        if self.allow is not None:
            self.allow.maybe_reload()
        for received in received_batch:
            with self.lock:  # per message: the drafting thread's deliveries wait one at most
                self.stats.messages += 1
                for reply in self.handle(received.peer, received.frames, received.user_id):
                    self._send(received.peer, reply)

    def _deliver_batch(self, batch: list[DraftJob], results: list[Proposal | Error],
                       started: float) -> None:  # fmt: skip
        for job, result in zip(batch, results, strict=True):
            self._deliver(job, result, started)

    async def _stats_loop(self) -> None:
        reported = 0
        while True:
            await asyncio.sleep(self.config.stats_interval)
            if self.stats.jobs != reported:  # only when something happened since the last line
                reported = self.stats.jobs
                self._log_stats()

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            self.expire_leases(time.monotonic())

    def expire_leases(self, now: float) -> int:
        """Forget every target silent for LEASE_INTERVALS heartbeats; returns how many."""
        lease = LEASE_INTERVALS * self.config.heartbeat_s
        with self.lock:
            dead = [p for p in self.peers.values() if now - p.last_seen > lease]
            for peer in dead:
                freed = self._forget_peer(peer)
                self.stats.sessions_expired += freed
                log.info("target %s silent for %.1f s: lease expired, freed %d sessions",
                         peer.stats.name, now - peer.last_seen, freed)  # fmt: skip
        return len(dead)

    def _forget_peer(self, peer: Peer) -> int:
        self.peers.pop(peer.routing_id, None)
        tags = [t for t in peer.tags if t in self.sessions]
        for tag in tags:
            self._close(self.sessions[tag])
        return len(tags)

    def _send(self, routing_id: bytes, msg: protocol.Message) -> bool:
        if isinstance(msg, Error):
            self.stats.errors_sent += msg.code != ErrorCode.SHUTTING_DOWN  # notices aren't errors
            log.info("-> %s ERROR %s: %s", routing_id.hex()[:10], msg.code, msg.message)
        if isinstance(msg, (Opened, Proposal, Pong, Error, Stats)):
            msg = dataclasses.replace(msg, epoch=self.epoch)
        assert self.router is not None, "sending needs serve()"
        return self.router.send(routing_id, msg)

    def _deliver(self, job: DraftJob, result: Proposal | Error, started: float) -> None:
        session = self.sessions.get(job.tag)
        if session is None:  # closed while drafting: nothing to send, state is already dropped
            return
        session.in_flight = False
        peer = self.peers.get(session.routing_id)
        if peer is not None:
            peer.stats.jobs += 1
            peer.stats.queue_wait_s += started - job.enqueued_at
        if isinstance(result, Proposal):
            session.next_seq = job.seq + 1
            session.last_gamma = len(result.tokens)
        if not self._send(session.routing_id, result):
            # The target will not see this proposal: free the state now; the target re-opens
            # from its own tokens when its DRAFT gets UNKNOWN_SESSION or its deadline passes.
            self._close(session)
            self.stats.sessions_dropped += 1

    # ------------------------------------------------------------------ dispatch

    def handle(
        self, routing_id: bytes, frames: list, user_id: str | None = None
    ) -> list[protocol.Message]:
        """Decode one message and act on it; returns the immediate replies. While serving,
        the caller holds ``self.lock``.

        ``user_id`` is the CURVE key of the sender (None in plain text). Nothing is allocated
        for a sender until its HELLO is accepted.
        """
        peer = self.peers.get(routing_id)
        try:
            self._authenticate(routing_id, user_id)
            msg = protocol.decode(frames)
            if peer is not None:
                peer.last_seen = time.monotonic()
            return self._dispatch(routing_id, user_id, peer, msg)
        except ProtocolError as exc:
            if peer is not None:
                peer.stats.errors += 1
            tag, seq = (exc.tag, exc.seq) if isinstance(exc, _SessionError) else (None, None)
            return [Error(exc.code, exc.message, tag=tag, seq=seq)]
        except Exception as exc:  # a bug must cost one reply, never the receive loop
            log.exception("internal error handling a message from %s", routing_id.hex())
            return [Error(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")]

    def _authenticate(self, routing_id: bytes, user_id: str | None) -> None:
        if self.allow is None or self.allow.is_allowed(user_id):
            return
        self.stats.unauthenticated += 1
        peer = self.peers.get(routing_id)
        if peer is not None:  # revoked while connected: its state goes at once
            log.warning("target %s: key no longer allowed, freed %d sessions", peer.stats.name,
                        self._forget_peer(peer))  # fmt: skip
        raise ProtocolError(ErrorCode.UNAUTHENTICATED, "this key is not allowed on this hub")

    def _dispatch(
        self, routing_id: bytes, user_id: str | None, peer: Peer | None, msg: protocol.Message
    ) -> list[protocol.Message]:
        match msg:
            case Hello():
                return [self._hello(routing_id, user_id, msg)]
            case Ping(nonce=nonce):
                return [Pong(nonce)]
            case StatsRequest(nonce=nonce):
                return [self.snapshot(nonce)]
            case Pong():
                return []
            case Error(code=code, message=text):
                log.info("<- %s ERROR %s: %s", routing_id.hex()[:10], code, text)
                return []
        if peer is None:
            raise ProtocolError(ErrorCode.NOT_WELCOMED, "send HELLO before anything else")
        match msg:
            case Open():
                return self._open(peer, msg)
            case Draft():
                return self._draft(peer, msg)
            case Close(tag=tag):
                self._close(self._owned(peer, tag, None))
                return []
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{type(msg).__name__} is not sent to a hub")

    def _hello(self, routing_id: bytes, user_id: str | None, msg: Hello) -> Welcome | Error:
        if msg.version != protocol.PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"target speaks protocol {msg.version}, hub {protocol.PROTOCOL_VERSION}",
            )
        differences = protocol.compatibility_problems(self.welcome, msg)
        if differences:
            log.warning("refused target %s (%s): %s", routing_id.hex(), msg.model, differences)
            return Error(ErrorCode.INCOMPATIBLE, f"target refused: {differences}")
        if routing_id not in self.peers:
            key = user_id.encode() if user_id is not None else routing_id
            name = self._peer_name(routing_id, user_id, msg.model)
            self.peers[routing_id] = Peer(routing_id, key, TargetStats(name=name))
            log.info("target %s connected (vocab %d)", name, msg.vocab_size)
        return self.welcome

    def _peer_name(self, routing_id: bytes, user_id: str | None, model: str) -> str:
        key_name = self.allow.name_of(user_id) if self.allow is not None else None
        return f"{routing_id.hex()}/{key_name or model}"

    def _open(self, peer: Peer, msg: Open) -> list[protocol.Message]:
        refusal = self._open_refusal(peer, msg)
        if refusal is not None:
            return [Error(refusal[0], refusal[1], ref=msg.ref)]
        tag = secrets.token_bytes(protocol.TAG_BYTES)
        gamma = msg.gamma or self.config.gamma
        state = self.drafter.new_state(msg.prompt.tolist(), msg.sampling, gamma)
        session = Session(tag=tag, owner=peer.key, routing_id=peer.routing_id, state=state)
        self.sessions[tag] = session
        peer.tags.add(tag)
        peer.stats.sessions += 1
        self._enqueue(session, DraftJob(tag, 0, state, 0, (), features=msg.features))
        return [Opened(ref=msg.ref, tag=tag)]

    def _open_refusal(self, peer: Peer, msg: Open) -> tuple[str, str] | None:
        gamma = msg.gamma or self.config.gamma
        problem = self._token_problem(msg.prompt, allow_empty=False)
        if self.draining:
            return ErrorCode.SHUTTING_DOWN, "hub is stopping; not opening sessions"
        if len(self.sessions) >= self.config.max_sessions:
            return ErrorCode.RESOURCE_EXHAUSTED, "hub is at --max-sessions"
        if len(peer.tags) >= self.config.max_sessions_per_target:
            return ErrorCode.RESOURCE_EXHAUSTED, (
                f"this target has {len(peer.tags)} sessions (--max-sessions-per-target)")
        if not 1 <= gamma <= self.config.max_gamma:
            return ErrorCode.INVALID_ARGUMENT, f"gamma {gamma} outside 1..{self.config.max_gamma}"
        if problem:
            return ErrorCode.INVALID_ARGUMENT, f"prompt: {problem}"
        return self._feature_problem(msg.features, msg.prompt.size - 1)

    def _feature_problem(self, features: np.ndarray | None, rows: int) -> tuple[str, str] | None:
        """Features must come exactly when the drafter uses them, with the announced shape and
        dtype and finite values; anything else is refused before state changes."""
        width, dtype = self.welcome.feature_width, self.welcome.feature_dtype
        if not width:
            if features is None:
                return None
            return ErrorCode.INVALID_ARGUMENT, "this hub does not take features"
        if features is None:
            return ErrorCode.INVALID_ARGUMENT, f"features [{rows}, {width}] are required"
        if features.shape != (rows, width) or features.dtype.name != dtype:
            return ErrorCode.INVALID_ARGUMENT, (
                f"features must be [{rows}, {width}] {dtype}, got "
                f"{list(features.shape)} {features.dtype.name}")  # fmt: skip
        if not np.isfinite(features).all():
            return ErrorCode.INVALID_ARGUMENT, "features contain NaN or infinity"
        return None

    def _draft(self, peer: Peer, msg: Draft) -> list[protocol.Message]:
        session = self._owned(peer, msg.tag, msg.seq)
        refusal = self._draft_refusal(session, msg)
        if refusal is not None:
            return [Error(refusal[0], refusal[1], tag=msg.tag, seq=msg.seq)]
        peer.stats.record_verdict(session.last_gamma, msg.accepted)
        if session.routing_id != peer.routing_id:  # the owner reconnected (same CURVE key)
            self._move(session, peer)
        appended = tuple(msg.appended.tolist())
        self._enqueue(session, DraftJob(msg.tag, msg.seq, session.state, msg.accepted, appended,
                                        features=msg.features))  # fmt: skip
        return []

    def _draft_refusal(self, session: Session, msg: Draft) -> tuple[str, str] | None:
        # Nothing about the session changes unless every check passes: a duplicate or
        # out-of-order DRAFT is refused and never applied twice.
        if self.draining:
            return ErrorCode.SHUTTING_DOWN, "hub is stopping; continue without proposals"
        if session.in_flight:
            return ErrorCode.BUSY, "a proposal for this session is being drafted"
        if msg.seq != session.next_seq:
            return ErrorCode.OUT_OF_ORDER, f"expected seq {session.next_seq}, got {msg.seq}"
        if not 0 <= msg.accepted <= session.last_gamma:
            return ErrorCode.INVALID_ARGUMENT, (
                f"accepted {msg.accepted} outside 0..{session.last_gamma}"
            )
        problem = self._token_problem(msg.appended, allow_empty=True)
        if problem:
            return ErrorCode.INVALID_ARGUMENT, f"appended: {problem}"
        return self._feature_problem(msg.features, msg.accepted + msg.appended.size)

    def _owned(self, peer: Peer, tag: bytes, seq: int | None) -> Session:
        session = self.sessions.get(tag)
        if session is None:
            raise _SessionError(ErrorCode.UNKNOWN_SESSION, "no such session", tag, seq)
        if session.owner != peer.key:
            log.warning("target %s named a session it does not own", peer.stats.name)
            raise _SessionError(ErrorCode.FORBIDDEN, "session belongs to another target", tag, seq)
        return session

    def _close(self, session: Session) -> None:
        del self.sessions[session.tag]
        peer = self.peers.get(session.routing_id)
        if peer is not None:
            peer.tags.discard(session.tag)

    def _move(self, session: Session, peer: Peer) -> None:
        old = self.peers.get(session.routing_id)
        if old is not None:
            old.tags.discard(session.tag)
        session.routing_id = peer.routing_id
        peer.tags.add(session.tag)

    def _enqueue(self, session: Session, job: DraftJob) -> None:
        session.in_flight = True
        self.q_in.put(session.owner, job)

    def _token_problem(self, ids: np.ndarray, allow_empty: bool) -> str | None:
        if ids.size == 0:
            return None if allow_empty else "empty"
        if ids.size > max(protocol.MAX_APPENDED, self.max_positions or 0):
            return f"{ids.size} tokens is too many"
        values = ids.tolist()  # min/max of a list: numpy reductions cost more on a few tokens
        if min(values) < 0 or max(values) >= self.vocab_size:
            return f"token id outside 0..{self.vocab_size - 1}"
        return None

    # ------------------------------------------------------------------ reporting

    def snapshot(self, nonce: int = 0) -> Stats:
        """Hub-wide counters since start, as sent in reply to STATS_REQUEST."""
        peers = [p.stats for p in self.peers.values()]
        return Stats(
            nonce=nonce,
            wall_s=time.perf_counter() - self.stats.started,
            busy_s=self.stats.busy_now(),
            jobs=self.stats.jobs,
            batches=self.stats.batches,
            sessions=len(self.sessions),
            targets=len(self.peers),
            rounds=sum(s.rounds for s in peers),
            proposed=sum(s.proposed for s in peers),
            accepted=sum(s.accepted for s in peers),
            queue_wait_s=sum(s.queue_wait_s for s in peers),
        )

    def _log_stats(self) -> None:
        with self.lock:
            log.info(self.stats.line(len(self.sessions), len(self.peers)))
            for peer in self.peers.values():
                if peer.stats.jobs:
                    log.info(peer.stats.line())

    def _log_summary(self) -> None:
        log.info("hub stopped after %.1f s; summary:", time.perf_counter() - self.stats.started)
        self._log_stats()


class _SessionError(ProtocolError):
    def __init__(self, code: str, message: str, tag: bytes, seq: int | None) -> None:
        super().__init__(code, message)
        self.tag = tag
        self.seq = seq


# ---------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m starsd.hub`` (argument parsing and start-up: starsd.hub_main)."""
    from starsd import hub_main

    return hub_main.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
