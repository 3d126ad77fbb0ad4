"""ZeroMQ transport: sockets configured for StarSD and message send/receive at the boundary.

Frames in, typed messages out (via :mod:`starsd.protocol`); nothing past this module sees raw
frames. Targets use zmq.asyncio DEALERs; the hub's ROUTER is a synchronous socket read by a
reader callback on the event loop and written from any thread (:class:`Router`). Sends never
block (NOBLOCK, and the hub's ROUTER reports unroutable peers instead of dropping silently).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from starsd import auth, curve_client, protocol

log = logging.getLogger(__name__)

# A frame larger than this makes libzmq drop the connection before any byte reaches us; frames
# between protocol.MAX_FRAME_BYTES and this get a TOO_LARGE error reply instead.
SOCKET_MAX_MSG_BYTES = 4 * protocol.MAX_FRAME_BYTES
HWM = 10_000
HEARTBEAT_MS = 1000  # ZMTP heartbeat: a silent connection is closed after 3 intervals
PUMP_LIMIT = 1024  # messages per reader turn, so timers and deliveries get their turns too
T = TypeVar("T")


@dataclass(frozen=True)
class Received:
    """One message from a peer: its routing id, its frames and, with CURVE, its key (z85).

    ``user_id`` is the ZAP-authenticated public key, the one identity a peer cannot choose;
    None in plain-text mode.
    """

    peer: bytes
    frames: list[zmq.Frame]
    user_id: str | None = None


def new_context() -> zmq.asyncio.Context:
    """A fresh asyncio ZeroMQ context (one per process or per test)."""
    return zmq.asyncio.Context()


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
        self._lock = threading.Lock()  # the socket, and whether a pump is scheduled
        self._scheduled = False

    @property
    def endpoint(self) -> str:
        """The endpoint actually bound (port 0 / wildcard resolved)."""
        return bound_endpoint(self.sock)

    def start(self, on_batch: Callable[[list[Received]], None]) -> None:
        """Call ``on_batch`` on the running loop with every batch of messages from now on."""
        self._loop = asyncio.get_running_loop()
        self._on_batch = on_batch
        self._loop.add_reader(self.sock.FD, self._pump)
        with self._lock:
            self._watch()  # messages queued before the reader existed

    def send(self, peer: bytes, msg: protocol.Message) -> bool:
        """Send ``msg`` to ``peer`` without blocking; False (and a log line) if it cannot go.
        Any thread may call it."""
        try:
            self.send_frames(peer, protocol.encode(msg))
            return True
        except zmq.Again:
            log.warning("peer %s is not reading (HWM reached): dropped %s", peer.hex(), _kind(msg))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.info("peer %s is gone: dropped %s", peer.hex(), _kind(msg))
        return False

    def send_frames(self, peer: bytes, frames: list[Any]) -> None:
        """Send raw frames without blocking (zmq.Again / EHOSTUNREACH propagate)."""
        with self._lock:
            try:
                self.sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
            finally:
                self._watch()

    def close(self) -> None:
        """Stop watching and close without lingering (once no other thread sends)."""
        if self._loop is not None and not self.sock.closed:
            self._loop.remove_reader(self.sock.FD)
        with self._lock:
            self.sock.close(linger=0)

    def _watch(self) -> None:
        # Called with the lock held, on any thread.
        if self._scheduled or self._loop is None or self.sock.closed:
            return
        if int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
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
        while int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
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


def _ignore(batch: list[Received]) -> None:
    del batch


def router(
    ctx: zmq.Context, endpoint: str, curve: auth.CurveServerConfig | None = None,
    heartbeat_ms: int = HEARTBEAT_MS,
) -> Router:  # fmt: skip
    """The hub's ROUTER socket, bound to ``endpoint`` (CURVE server when ``curve`` is given;
    the context must then run :func:`auth.start_authenticator` first)."""
    sock: zmq.Socket = zmq.Context.shadow(ctx.underlying).socket(zmq.ROUTER)  # sync: see Router
    _common_options(sock, heartbeat_ms)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH/EAGAIN instead of a silent drop
    # ROUTER_HANDOVER stays off: a new connection can never take over a live routing id.
    if curve is not None:
        auth.secure_server(sock, curve)
    sock.bind(endpoint)
    return Router(sock, curve is not None)


def dealer(
    ctx: zmq.asyncio.Context, endpoint: str, curve: curve_client.CurveClientConfig | None = None,
    heartbeat_ms: int = HEARTBEAT_MS,
) -> tuple[zmq.asyncio.Socket, curve_client.HandshakeWatch | None]:  # fmt: skip
    """A target's DEALER connected to ``endpoint``; the hub assigns its routing id.

    With ``curve``, also returns a watch on the handshake (attached before connecting): await
    ``watch.wait()`` so a rejected key fails loudly instead of hanging.
    """
    sock = ctx.socket(zmq.DEALER)
    _common_options(sock, heartbeat_ms)
    watch = None
    if curve is not None:
        curve_client.secure_client(sock, curve)
        watch = curve_client.watch_handshake(sock)
    sock.connect(endpoint)
    return sock, watch


def _common_options(sock: zmq.Socket, heartbeat_ms: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_MSG_BYTES)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if heartbeat_ms > 0:  # ZMTP PING/PONG: closes connections to dead or hung peers
        sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * heartbeat_ms)


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint a socket actually bound (resolves port 0 / wildcard binds)."""
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


async def send(sock: zmq.asyncio.Socket, msg: protocol.Message) -> None:
    """Send ``msg`` on a DEALER (waits only if the HWM is reached)."""
    await sock.send_multipart(protocol.encode(msg), copy=False)


async def recv(sock: zmq.asyncio.Socket) -> protocol.Message:
    """Receive and decode one message on a DEALER; raises ProtocolError if malformed."""
    frames = await sock.recv_multipart(copy=False)
    return protocol.decode(frames)


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when it is installed, else on the default asyncio loop.

    The GIL switch interval drops from 5 ms to 0.5 ms: the model thread runs long stretches of
    Python (framework overhead), and a message must not wait 5 ms for the event loop to get in.
    """
    sys.setswitchinterval(0.0005)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _kind(msg: protocol.Message) -> str:
    return type(msg).__name__.upper()
