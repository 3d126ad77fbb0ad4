"""The hub's ROUTER socket: one reader callback on the event loop, sends from any thread.

Hub side only (targets use :func:`starsd.transport.dealer`). A synchronous libzmq socket read by
a reader callback on the event loop and written from any thread (:class:`Router`). Sends never
block (NOBLOCK, and the ROUTER reports unroutable peers instead of dropping silently).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from starsd import protocol, transport
from starsd.hub import auth, gate
from starsd.limits import HUB_MAX_FRAME_BYTES, HUB_RCVHWM, HUB_SNDHWM
from starsd.logsafe import Throttle

log = logging.getLogger(__name__)

PUMP_LIMIT = 1024  # messages per reader turn, so timers and deliveries get their turns too
DEAF_S = 1.0  # after a send finds a peer's queue full, its replies are dropped this long
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum flags cost per call


@dataclass(frozen=True)
class Received:
    """One message from a peer: its routing id, its frames and, with CURVE, its key (z85).

    ``user_id`` is the ZAP-authenticated public key, the one identity a peer cannot choose;
    None in plain-text mode.
    """

    peer: bytes
    frames: list[zmq.Frame]
    user_id: str | None = None


class Router:
    """The hub's ROUTER socket, read by one reader callback on the event loop, written from any
    thread.

    A synchronous libzmq socket: the loop watches its FD and :meth:`_pump` reads every queued
    message (NOBLOCK, while ZMQ_EVENTS shows input) and hands them to the handler in one batch;
    :meth:`send` is a NOBLOCK send that any thread may call, so the drafting thread sends its
    proposals without waking the loop (a cross-thread hand-off cost 35-40 us on this project's
    2-vCPU test VM, several times that after an idle spell).
    libzmq sockets are not thread-safe, but may move between threads behind a full memory
    barrier: every socket operation runs under one lock. No future is created per message
    (zmq.asyncio's poll/send machinery cost 0.05-0.1 ms per round).

    libzmq's FD is edge-triggered: any operation on the socket, a send included, may consume
    the notification of a message that arrived meanwhile. So every operation ends in a
    ZMQ_EVENTS check (:meth:`_watch`, or the read loop's own) that schedules another pump if
    input is waiting; a send that skipped this check once left the hub deaf to a target for a
    minute.
    """

    def __init__(self, sock: zmq.Socket, curve: bool = False) -> None:
        self.sock = sock
        self.curve = curve
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_batch: Callable[[list[Received]], None] = _ignore
        self._lock = threading.Lock()  # the socket and every field below
        self._scheduled = False
        self._paused = False  # reading is paused (a flood): no pump until it resumes
        self._deaf_until: dict[bytes, float] = {}  # peers not reading, and until when
        self._quiet = Throttle()  # a peer decides how often sends fail: one line per 10 s
        self._dropped_count = 0  # replies that could not be sent (peer not reading, or gone)

    @property
    def dropped(self) -> int:
        """Replies that could not be sent since start (peer not reading, or gone)."""
        with self._lock:
            return self._dropped_count

    @property
    def endpoint(self) -> str:
        """The endpoint actually bound (port 0 / wildcard resolved)."""
        return transport.bound_endpoint(self.sock)

    def start(self, on_batch: Callable[[list[Received]], None]) -> None:
        """Call ``on_batch`` on the running loop with every batch of messages from now on."""
        self._loop = asyncio.get_running_loop()
        self._on_batch = on_batch
        self._loop.add_reader(self.sock.FD, self._pump)
        with self._lock:
            self._watch()  # messages queued before the reader existed

    def send(self, peer: bytes, msg: protocol.Message) -> bool:
        """Send ``msg`` to ``peer`` without blocking; False if it cannot go. Any thread.

        A peer whose queue was full (it does not read) gets nothing for ``DEAF_S``: its replies
        are dropped before they are encoded, so a flooder that never reads costs no sends.
        """
        with self._lock:
            if self._deaf_until.get(peer, 0.0) > time.monotonic():
                self._dropped_count += 1
                return False
        try:
            self.send_frames(peer, protocol.encode(msg))
            return True
        except zmq.Again:
            self._dropped(peer, msg, "is not reading (HWM reached)", deaf=True)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._dropped(peer, msg, "is gone", deaf=False)
        return False

    def _dropped(self, peer: bytes, msg: protocol.Message, why: str, deaf: bool) -> None:
        with self._lock:
            self._dropped_count += 1
            if deaf:
                if len(self._deaf_until) > 10_000:  # routing ids come and go: bound the table
                    self._deaf_until.clear()
                self._deaf_until[peer] = time.monotonic() + DEAF_S
            held = self._quiet.allow((peer, why))
        if held is not None:
            log.warning(
                "peer %s %s: dropped %s (%d more since the last line)",
                peer.hex()[:10],
                why,
                _kind(msg),
                held,
            )

    def send_frames(self, peer: bytes, frames: list[Any]) -> None:
        """Send raw frames without blocking (zmq.Again / EHOSTUNREACH propagate)."""
        with self._lock:
            try:
                self.sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
            finally:
                self._watch()

    def pause(self, seconds: float) -> None:
        """Stop reading for ``seconds`` (event loop only): a flood then waits in its senders'
        queues and TCP buffers instead of costing the hub a receive per message."""
        if self._loop is None or self._paused or self.sock.closed:
            return
        self._paused = True
        self._loop.remove_reader(self.sock.FD)
        self._loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        self._paused = False
        if self._loop is None or self.sock.closed:
            return
        self._loop.add_reader(self.sock.FD, self._pump)
        with self._lock:
            self._watch()

    def close(self) -> None:
        """Stop watching and close without lingering (once no other thread sends)."""
        if self._loop is not None and not self.sock.closed:
            self._loop.remove_reader(self.sock.FD)
        with self._lock:
            self.sock.close(linger=0)

    def _watch(self) -> None:
        # Called with the lock held, on any thread.
        if self._scheduled or self._paused or self._loop is None or self.sock.closed:
            return
        if _input_waiting(self.sock):
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._pump)

    def _pump(self) -> None:
        with self._lock:
            self._scheduled = False
            if self.sock.closed:
                return
            batch = self._read(PUMP_LIMIT)
        if batch:
            self._on_batch(batch)  # (its sends re-check the socket themselves)

    def _read(self, limit: int) -> list[Received]:
        # Reads while ZMQ_EVENTS shows input, rather than until a recv raises EAGAIN (an
        # exception per pump costs more than the check); the last check re-arms the FD.
        batch: list[Received] = []
        while _input_waiting(self.sock):
            if len(batch) == limit:  # more waiting: another turn, after timers and others
                self._watch()
                break
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) < 2:  # ROUTER always prepends the routing id; anything else is noise
                continue
            key = auth.user_id(frames[0]) if self.curve else None
            batch.append(Received(bytes(frames[0].buffer), list(frames[1:]), key))
        return batch


def _input_waiting(sock: zmq.Socket) -> bool:
    return bool(int(sock.get(_EVENTS)) & _POLLIN)


def _ignore(batch: list[Received]) -> None:
    del batch


HUB_HANDSHAKE_MS = gate.HANDSHAKE_MS  # a peer that has not finished its handshake is dropped


class BindError(OSError):
    """The hub's endpoint cannot be bound (in use, no such interface, a malformed address)."""


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        problem = zmq.strerror(exc.errno) if exc.errno else str(exc)
        raise BindError(f"cannot bind {endpoint}: {problem}") from exc


def bind_router(
    ctx: zmq.Context,
    endpoint: str,
    curve: auth.CurveServerConfig | None = None,
    max_frame_bytes: int = HUB_MAX_FRAME_BYTES,
    limits: gate.ConnectionLimits = gate.DEFAULT_LIMITS,
) -> Router:
    """The hub's ROUTER socket, bound to ``endpoint`` (CURVE server when ``curve`` is given;
    the context must then run :func:`gate.start_authenticator` first, whose ``limits`` apply;
    in plain text this starts one with ``limits``, stopped by :meth:`Router.close`).

    Every handshake goes through that ZAP handler, which gives each connection a random
    routing id of its own (never the one the peer asks for) and holds the connections to
    :class:`gate.ConnectionLimits`; the automatic ids libzmq still assigns to a peer that
    outwaits the handler are made unpredictable first (:func:`seed_routing_ids`). Frames over
    ``max_frame_bytes`` drop the connection before they are buffered
    (:func:`hub_max_frame_bytes` sizes it to what a hub can legitimately receive).
    """
    guard = gate.start_authenticator(ctx, None, limits=limits) if curve is None else None
    sock: zmq.Socket | None = None
    try:
        gatekeeper = gate.running_on(ctx)
        seed_routing_ids()
        sock = zmq.Context.shadow(ctx.underlying).socket(zmq.ROUTER)  # sync: Router
        # No ZMTP heartbeats: libzmq 4.3.5 aborts the process (assert !_io_error,
        # stream_engine_base.cpp:310) when a heartbeat timer fires on a connection whose peer
        # vanished while its input was stopped at the high-water mark, which any peer can
        # arrange (tests/test_router.py); targets send none either. A silent target loses its
        # state with its lease; a dead one's connection closes with its TCP connection.
        transport.common_options(sock, heartbeat_ms=0)
        hub_options(sock, max_frame_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH/EAGAIN instead of a silent drop
        # ROUTER_HANDOVER stays off: a new connection can never take over a live routing id.
        if curve is not None:
            auth.secure_server(sock, curve)
        else:  # plain text through ZAP too: the handler assigns the routing ids
            sock.setsockopt(zmq.ZAP_DOMAIN, auth.ZAP_DOMAIN.encode())
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        if gatekeeper is not None:
            gatekeeper.watch(sock)
        _bind(sock, endpoint)
    except BaseException:
        if sock is not None:  # an open socket would block the context's term() for ever
            sock.close(linger=0)
        if guard is not None:
            guard.stop()
        raise
    held = (
        _limits_text(gatekeeper.limits) if gatekeeper is not None else "any number of connections"
    )
    log.info(
        "hub socket: frames up to %d B, RCVHWM %d, handshake within %d ms, at most %s",
        max_frame_bytes,
        HUB_RCVHWM,
        HUB_HANDSHAKE_MS,
        held,
    )
    return _GuardedRouter(sock, curve is not None, guard)


def hub_options(sock: zmq.Socket, max_frame_bytes: int) -> None:
    """What a hub socket tightens over :func:`transport.common_options`: the frame limit,
    the queues and the handshake time."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.RCVHWM, HUB_RCVHWM)
    sock.setsockopt(zmq.SNDHWM, HUB_SNDHWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HUB_HANDSHAKE_MS)


def seed_routing_ids() -> None:
    """Seed libc's ``rand()`` from the OS: libzmq 4.3.5 never seeds it and starts each
    ROUTER's automatic routing ids at its next value, so every fresh process would hand out
    the same ids (0x6b8b4567, +1 per connection), which a peer can claim in advance."""
    libc = ctypes.CDLL(None)
    libc.srand(ctypes.c_uint(secrets.randbits(32)))


class _GuardedRouter(Router):
    """A :class:`Router` that stops the plain-text ZAP handler it came with when it closes."""

    def __init__(self, sock: zmq.Socket, curve: bool, guard: gate.Authenticator | None) -> None:
        super().__init__(sock, curve)
        self.guard = guard

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.guard is not None:
                self.guard.stop()  # after the socket: its monitor must not outlive it


def _limits_text(limits: gate.ConnectionLimits) -> str:
    return (
        f"{limits.max_connections} connections ({limits.max_per_address} per address), "
        f"{limits.max_new} new per {gate.HANDSHAKE_MS} ms ({limits.max_new_per_address} per "
        "address)"
    )


def _kind(msg: protocol.Message) -> str:
    return type(msg).__name__.upper()
