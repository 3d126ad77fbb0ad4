"""The hub's event-loop side: read the ROUTER, dispatch each message, keep leases, report.

The event loop never runs the model. It decodes each message, applies it to the session table
(:mod:`starsd.hub.sessions`) and puts draft jobs into the global queue Q_in (fair across targets,
:mod:`starsd.hub.scheduler`); the drafting thread (:mod:`starsd.hub.engine`) takes them, drafts
and sends the proposals itself.

Threads: the loop runs ``on_messages``, the lease and stats timers and the drain; the drafting
thread runs ``DraftingEngine.run``. ``Hub.lock`` guards everything they share: the session table
(peers, sessions, per-target counters) and ``HubStats``. ``send`` is called by both, lock held.

Faults: any message renews its target's lease; a target silent for ``LIVENESS_INTERVALS``
heartbeats loses its sessions and draft state. Every reply carries the hub's random epoch, so a
target notices a restarted hub and re-opens its sessions from its own committed tokens. SIGTERM
drains: no new sessions, in-flight rounds are delivered, every target is told SHUTTING_DOWN.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import zmq.asyncio

from starsd import limits, protocol
from starsd.budget import PeerBudget, Rates
from starsd.hub import auth, gate, report, router
from starsd.hub.config import HubConfig
from starsd.hub.drafters.base import DraftJob, Proposer
from starsd.hub.engine import DraftingEngine
from starsd.hub.pacing import Pacer
from starsd.hub.scheduler import FairQueue
from starsd.hub.sessions import Limits, Peer, Refused, Session, SessionTable
from starsd.logsafe import Throttle, printable
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
from starsd.stats import HubStats

if TYPE_CHECKING:  # built by build.py for draft-LLM hubs; this module only passes it on
    from starsd.hub.predraft import Predrafter

log = logging.getLogger("starsd.hub")

_STAMPED = (Opened, Proposal, Pong, Error, Stats)  # hub replies that carry the epoch
FLOOD_BATCH = 128  # messages over budget in one read turn that mean a flood
MAX_PAUSE_S = 0.02  # longest pause of the reading after such a turn (a legit message waits it)


class Hub:
    """The event loop's side of the hub; see the module docstring."""

    def __init__(
        self,
        config: HubConfig,
        proposer: Proposer,
        welcome: Welcome,
        table_limits: Limits,
        pacer: Pacer,
        predrafter: Predrafter | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.welcome = welcome
        self.epoch = welcome.epoch
        self.lock = threading.Lock()  # guards table and stats: event loop vs drafting thread
        self.table = SessionTable(table_limits)
        self.stats = HubStats()
        self.budget = PeerBudget(
            Rates(config.peer_budget, config.peer_budget, enabled=config.peer_budget > 0)
        )
        self.quiet = Throttle()  # log lines a peer can trigger at will: one per 10 s per kind
        self.q_in: FairQueue[DraftJob] = FairQueue()
        self.pacer = pacer  # the drafting thread's --gamma auto
        self.engine = DraftingEngine(
            proposer,
            self.pacer,
            self.q_in,
            self.table,
            self.lock,
            self.send,
            self.stats,
            config.max_batch,
            predrafter,
            config.gather,
        )
        self.router: router.Router | None = None  # set while serving
        self.stopping = asyncio.Event()
        self.failed = False  # the drafting thread stopped while serving (exit non-zero)
        self.allow: auth.AllowList | None = None
        self.endpoint = ""

    @property
    def sessions(self) -> dict[bytes, Session]:
        """Live sessions by tag (read under the lock while serving)."""
        return self.table.sessions

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, ctx: zmq.asyncio.Context) -> None:
        """Bind, run until ``stop()``, drain, then shut down cleanly and log the summary."""
        authenticator = self._start_security(ctx)
        frame_limit = limits.hub_max_frame_bytes(
            self.proposer.max_positions,
            self.welcome.feature_width,
            self.welcome.feature_dtype,
            self.config.max_gamma,
        )
        try:
            self.router = sock = router.bind_router(
                ctx, self.config.bind, self.config.curve, max_frame_bytes=frame_limit
            )
        except BaseException:
            if authenticator is not None:
                authenticator.stop()
            raise
        self.endpoint = sock.endpoint
        self.engine.start()
        self._log_start()
        sock.start(self.on_messages)
        tasks = [asyncio.create_task(c) for c in (self._stats_loop(), self._lease_loop())]
        try:
            await self.stopping.wait()
            await self._drain()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.q_in.close()
            await asyncio.to_thread(self.engine.thread.join)
            sock.close()
            if authenticator is not None:
                authenticator.stop()
            self._log_summary()

    def stop(self) -> None:
        """Ask ``serve`` to drain and finish (safe from signal handlers on the loop)."""
        self.stopping.set()

    def _start_security(self, ctx: zmq.asyncio.Context) -> gate.CurveAuthenticator | None:
        curve = self.config.curve
        if curve is None:
            auth.check_plaintext_endpoint(self.config.bind, allow_insecure=self.config.insecure)
            return None
        self.allow = auth.AllowList(curve.allow_dir)
        return gate.start_authenticator(ctx, self.allow)

    def _log_start(self) -> None:
        allowed = len(self.allow) if self.allow is not None else None
        model, epoch = self.welcome.model, self.epoch
        log.info("%s", report.start_line(self.config, self.endpoint, model, allowed, epoch))

    async def _drain(self) -> None:
        """Admit nothing new, deliver what is in flight, then tell every target we are going."""
        with self.lock:
            self.table.draining = True
            log.info(
                "draining: %d rounds in flight, %d sessions, timeout %.1f s",
                self.table.in_flight(),
                len(self.table.sessions),
                self.config.drain_timeout_s,
            )
        deadline = time.monotonic() + self.config.drain_timeout_s
        drafting = self.engine.thread.is_alive
        while self._in_flight() and time.monotonic() < deadline and drafting():
            await asyncio.sleep(0.01)
        dropped = self.q_in.clear()  # the timeout holds: a backlog is refused, not drafted
        if dropped:
            log.info("drain timeout: %d queued jobs dropped", dropped)
        with self.lock:
            for peer in self.table.peers.values():
                self.send(peer.routing_id, Error(ErrorCode.SHUTTING_DOWN, "hub is stopping"))
        await asyncio.sleep(0.05)  # let the I/O thread flush the notices (LINGER is 0)

    def _in_flight(self) -> int:
        with self.lock:
            return self.table.in_flight()

    # ------------------------------------------------------------------ event loop entry points

    def on_messages(self, received_batch: list[router.Received]) -> None:
        """The ROUTER reader's callback: handle each message and send its replies."""
        if self.allow is not None:
            self.allow.maybe_reload()
        started, dropped = time.perf_counter(), 0
        for received in received_batch:
            with self.lock:  # per message: the drafting thread's deliveries wait one at most
                self.stats.messages += 1
                if not self._within_budget(received.peer):
                    dropped += 1
                    continue
                for reply in self.handle(received.peer, received.frames, received.user_id):
                    self.send(received.peer, reply)
        if dropped >= FLOOD_BATCH and self.router is not None:
            # Mostly a flood: read at most half the time, so the drafting thread keeps its CPU.
            self.router.pause(min(MAX_PAUSE_S, time.perf_counter() - started))

    def _within_budget(self, routing_id: bytes) -> bool:
        peer = self.table.peers.get(routing_id)
        if self.budget.take(routing_id, len(peer.tags) if peer is not None else 0):
            return True
        self.stats.over_budget += 1
        held = self.quiet.allow(("budget", routing_id))
        if held is not None:
            log.warning(
                "peer %s is over its message budget: dropping its excess (%d more "
                "since the last line)",
                routing_id.hex()[:10],
                held,
            )
        return False

    async def _stats_loop(self) -> None:
        reported = 0
        while True:
            await asyncio.sleep(self.config.stats_interval)
            with self.lock:
                jobs = self.stats.jobs
            if jobs != reported:  # only when something happened since the last line
                reported = jobs
                self._log_stats()

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            self.expire_leases()
            with self.lock:
                self.budget.prune()
            if not self.engine.thread.is_alive():
                self._fail("the drafting thread has stopped")
                return

    def _fail(self, why: str) -> None:
        """Stop a hub that can no longer draft: answering pings while drafting nothing would
        keep its targets waiting out a deadline every round; stopped, they are told
        SHUTTING_DOWN and move to another hub or decode alone, and a supervisor restarts it."""
        log.error("%s; stopping the hub", why)
        self.failed = True
        self.stop()

    def expire_leases(self) -> int:
        """Forget every target silent for longer than its lease; returns how many."""
        with self.lock:
            dead = self.table.expired()
            for peer in dead:
                freed = self._forget(peer)
                self.stats.sessions_expired += freed
                log.info(
                    "target %s silent for %.1f s: lease expired, freed %d sessions",
                    peer.stats.name,
                    self.table.clock() - peer.last_seen,
                    freed,
                )
        return len(dead)

    # ------------------------------------------------------------------ replies (either thread)

    def send(self, routing_id: bytes, msg: protocol.Message) -> bool:
        """Send one reply, stamped with the epoch; False if it cannot be delivered.

        Called by the event loop and by the drafting thread, always with ``lock`` held.
        """
        if isinstance(msg, Error):
            self.stats.errors_sent += msg.code != ErrorCode.SHUTTING_DOWN  # notices aren't errors
            codes = self.stats.errors_by_code  # the hub's own codes: a bounded set
            codes[msg.code] = codes.get(msg.code, 0) + 1
            self._log_error("->", routing_id, msg)
        if isinstance(msg, _STAMPED):
            msg = dataclasses.replace(msg, epoch=self.epoch)
        assert self.router is not None, "sending needs serve()"
        return self.router.send(routing_id, msg)

    def _log_error(self, direction: str, routing_id: bytes, msg: Error) -> None:
        held = self.quiet.allow((direction, routing_id, msg.code))
        if held is not None:  # a peer decides how often this happens: throttled, escaped
            log.info(
                "%s %s ERROR %s: %s%s",
                direction,
                routing_id.hex()[:10],
                printable(msg.code, 24),
                printable(msg.message),
                f" ({held} more like it since the last line)" if held else "",
            )

    # ------------------------------------------------------------------ dispatch (lock held)

    def handle(
        self, routing_id: bytes, frames: list, user_id: str | None = None
    ) -> list[protocol.Message]:
        """Decode one message and act on it; returns the immediate replies. While serving,
        the caller holds ``self.lock``.

        ``user_id`` is the CURVE key of the sender (None in plain text). Nothing is allocated
        for a sender until its HELLO is accepted.
        """
        peer = self.table.peers.get(routing_id)
        try:
            self._authenticate(routing_id, user_id)
            msg = protocol.decode(frames)
            if peer is not None:
                self.table.seen(peer)
            return self._dispatch(routing_id, user_id, peer, msg)
        except ProtocolError as exc:
            return [self._refusal(peer, exc)]
        except Exception as exc:  # a bug must cost one reply, never the receive loop
            log.exception("internal error handling a message from %s", routing_id.hex())
            return [Error(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")]

    def _refusal(self, peer: Peer | None, exc: ProtocolError) -> Error:
        if peer is not None:
            peer.stats.errors += 1
        if not isinstance(exc, Refused):
            return Error(exc.code, exc.message)
        if (
            exc.code == ErrorCode.FORBIDDEN
            and peer is not None
            and self.quiet.allow(("forbidden", peer.routing_id)) is not None
        ):
            log.warning("target %s named a session it does not own", peer.stats.name)
        return Error(exc.code, exc.message, ref=exc.ref, tag=exc.tag, seq=exc.seq)

    def _authenticate(self, routing_id: bytes, user_id: str | None) -> None:
        if self.allow is None or self.allow.is_allowed(user_id):
            return
        self.stats.unauthenticated += 1
        peer = self.table.peers.get(routing_id)
        if peer is not None:  # revoked while connected: its state goes at once
            log.warning(
                "target %s: key no longer allowed, freed %d sessions",
                peer.stats.name,
                self._forget(peer),
            )
        raise ProtocolError(ErrorCode.UNAUTHENTICATED, "this key is not allowed on this hub")

    def _dispatch(
        self, routing_id: bytes, user_id: str | None, peer: Peer | None, msg: protocol.Message
    ) -> list[protocol.Message]:
        match msg:
            case Hello():
                return [self._hello(routing_id, user_id, msg)]
            case Ping(nonce=nonce):
                return [Pong(nonce, **self.load())]
            case StatsRequest(nonce=nonce):
                return [self.snapshot(nonce)]
            case Pong():
                return []
            case Error():
                self._log_error("<-", routing_id, msg)
                return []
        if peer is None:
            raise ProtocolError(ErrorCode.NOT_WELCOMED, "send HELLO before anything else")
        return self._session_message(peer, msg)

    def _session_message(self, peer: Peer, msg: protocol.Message) -> list[protocol.Message]:
        match msg:
            case Open():
                session = self.table.open(peer, msg, self.proposer.new_state)
                self._enqueue(session, 0, 0, (), msg.features)
                return [Opened(ref=msg.ref, tag=session.tag)]
            case Draft():
                session, proposed = self.table.draft(peer, msg)
                self.budget.refund(peer.routing_id)  # accepted work is bounded already
                appended = tuple(msg.appended.tolist())
                self._enqueue(
                    session,
                    msg.seq,
                    msg.accepted,
                    appended,
                    msg.features,
                    msg.taken,
                    proposed,
                    _tree_path(session, msg),
                    msg.others_us / 1e6,
                    msg.forward_us / 1e6,
                )
                return []
            case Close(tag=tag):
                self._unqueue([self.table.close(peer, tag)])
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
            log.warning(
                "refused target %s (%s): %s",
                routing_id.hex(),
                printable(msg.model),
                printable(differences, 400),
            )
            return Error(ErrorCode.INCOMPATIBLE, f"target refused: {differences}")
        key = user_id.encode() if user_id is not None else routing_id
        name = self._peer_name(routing_id, user_id, msg.model)
        peer = self.table.welcome(routing_id, key, name)
        if peer is not None:
            peer.tree_nodes = min(max(msg.tree_nodes, 0), self.welcome.tree_nodes)
            log.info(
                "target %s connected (vocab %d, trees of %d nodes)",
                name,
                msg.vocab_size,
                peer.tree_nodes,
            )
        return dataclasses.replace(self.welcome, **self.load())

    def load(self) -> report.LoadReport:
        """The load reported in WELCOME and PONG (lock held): see :func:`report.load`."""
        return report.load(self.table, len(self.q_in), self.stats)

    def _peer_name(self, routing_id: bytes, user_id: str | None, model: str) -> str:
        key_name = self.allow.name_of(user_id) if self.allow is not None else None
        return f"{routing_id.hex()}/{printable(key_name or model, 40)}"

    def _forget(self, peer: Peer) -> int:
        """Drop a peer, its sessions and their queued jobs; returns how many sessions went."""
        gone = self.table.forget(peer)
        self._unqueue(gone)
        return len(gone)

    def _unqueue(self, sessions: list[Session]) -> None:
        """Ended sessions' queued jobs are never drafted (a job being drafted is not sent)."""
        for session in sessions:
            self.q_in.remove(session.owner, _job_of(session.tag))

    def _enqueue(
        self,
        session: Session,
        seq: int,
        accepted: int,
        appended: tuple[int, ...],
        features: np.ndarray | None,
        taken: int = 0,
        proposed: int = 0,
        path: tuple[int, ...] | None = None,
        others_s: float = 0.0,
        forward_s: float = 0.0,
    ) -> None:
        job = DraftJob(
            session.tag,
            seq,
            session.state,
            accepted,
            appended,
            features=features,
            taken=taken,
            push=session.push,
            proposed=proposed,
            owner=session.owner,
            auto=not session.gamma_fixed,
            path=path,
            tree_nodes=session.tree_nodes,
            others_s=others_s,
            forward_s=forward_s,
        )
        self.q_in.put(session.owner, job)

    # ------------------------------------------------------------------ reporting

    def snapshot(self, nonce: int = 0) -> Stats:
        """Hub-wide counters since start, as sent in reply to STATS_REQUEST (lock held)."""
        return report.snapshot(self.table, self.stats, nonce)

    def _log_stats(self) -> None:
        with self.lock:
            dropped = self.router.dropped if self.router is not None else 0
            for line in report.stats_lines(self.table, self.stats, dropped):
                log.info("%s", line)

    def _log_summary(self) -> None:
        log.info("hub stopped after %.1f s; summary:", time.perf_counter() - self.stats.started)
        self._log_stats()


def _tree_path(session: Session, msg: Draft) -> tuple[int, ...] | None:
    """The accepted path of a verdict on a token tree (checked by the table), None after a
    chain."""
    if session.last_parents is None:
        return None
    return () if msg.path is None else tuple(msg.path.tolist())


def _job_of(tag: bytes) -> Callable[[DraftJob], bool]:
    """A test for the queued job of session ``tag``."""
    return lambda job: job.tag == tag
