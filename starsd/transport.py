"""ZeroMQ transport: sockets configured for StarSD and message send/receive at the boundary.

Frames in, typed messages out (via :mod:`starsd.protocol`); nothing past this module sees raw
frames. Sockets are zmq.asyncio sockets; sends never block the event loop (NOBLOCK, and the hub's
ROUTER reports unroutable peers instead of dropping silently).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from starsd import protocol, security

log = logging.getLogger(__name__)

# A frame larger than this makes libzmq drop the connection before any byte reaches us; frames
# between protocol.MAX_FRAME_BYTES and this get a TOO_LARGE error reply instead.
SOCKET_MAX_MSG_BYTES = 4 * protocol.MAX_FRAME_BYTES
HWM = 10_000
HEARTBEAT_MS = 1000  # ZMTP heartbeat: a silent connection is closed after 3 intervals
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


@dataclass(frozen=True)
class Router:
    """The hub's ROUTER socket: asyncio for waiting and sending, a synchronous shadow for the
    non-blocking receives of :func:`drain_router`.

    Both objects wrap the same libzmq socket, used only on the event loop thread. Draining on
    the shadow skips zmq.asyncio's future machinery (~50 us per message measured on this VM); it
    reads until EAGAIN before waiting again, so no arrival is missed. Sends stay on the asyncio
    socket (see :func:`send_to`).
    """

    sock: zmq.asyncio.Socket
    raw: zmq.Socket
    curve: bool = False

    @property
    def endpoint(self) -> str:
        """The endpoint actually bound (port 0 / wildcard resolved)."""
        return bound_endpoint(self.sock)

    def close(self) -> None:
        """Close without lingering."""
        self.sock.close(linger=0)


def router(
    ctx: zmq.asyncio.Context, endpoint: str, curve: security.CurveServerConfig | None = None,
    heartbeat_ms: int = HEARTBEAT_MS,
) -> Router:  # fmt: skip
    """The hub's ROUTER socket, bound to ``endpoint`` (CURVE server when ``curve`` is given;
    the context must then run :func:`security.start_authenticator` first)."""
    sock = ctx.socket(zmq.ROUTER)
    _common_options(sock, heartbeat_ms)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH/EAGAIN instead of a silent drop
    # ROUTER_HANDOVER stays off: a new connection can never take over a live routing id.
    if curve is not None:
        security.secure_server(sock, curve)
    sock.bind(endpoint)
    return Router(sock, zmq.Socket.shadow(sock.underlying), curve is not None)


def dealer(
    ctx: zmq.asyncio.Context, endpoint: str, curve: security.CurveClientConfig | None = None,
    heartbeat_ms: int = HEARTBEAT_MS,
) -> tuple[zmq.asyncio.Socket, security.HandshakeWatch | None]:  # fmt: skip
    """A target's DEALER connected to ``endpoint``; the hub assigns its routing id.

    With ``curve``, also returns a watch on the handshake (attached before connecting): await
    ``watch.wait()`` so a rejected key fails loudly instead of hanging.
    """
    sock = ctx.socket(zmq.DEALER)
    _common_options(sock, heartbeat_ms)
    watch = None
    if curve is not None:
        security.secure_client(sock, curve)
        watch = security.watch_handshake(sock)
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


async def drain_router(router: Router, limit: int = 1024) -> list[Received]:
    """Wait for input, then take every message already queued (up to ``limit``) without waiting.

    Draining instead of awaiting each message keeps per-message overhead low on a busy hub.
    """
    await router.sock.poll()  # POLLIN
    batch: list[Received] = []
    while len(batch) < limit:
        try:
            frames = router.raw.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
        if len(frames) < 2:  # ROUTER always prepends the routing id; anything else is noise
            continue
        key = security.user_id(frames[0]) if router.curve else None
        batch.append(Received(bytes(frames[0].buffer), list(frames[1:]), key))
    return batch


def send_to(router: Router, peer: bytes, msg: protocol.Message) -> bool:
    """Send ``msg`` to ``peer`` without blocking; False (and a log line) if it cannot go now."""
    # Through the asyncio socket, not the shadow: libzmq's socket FD is edge-triggered and a
    # send may consume the edge of a message that arrived meanwhile; pyzmq re-checks the
    # socket's events after its own sends and wakes a pending poll, a raw send would not (the
    # hub then missed a target's messages until something else touched the socket). On a
    # zmq.asyncio socket a NOBLOCK send completes at once and reports failure through the
    # returned future.
    frames = [peer, *protocol.encode(msg)]
    sent: Any = router.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    exc = sent.exception() if sent.done() else None
    if exc is None:
        return True
    if isinstance(exc, zmq.Again):
        log.warning("peer %s is not reading (HWM reached): dropped %s", peer.hex(), _kind(msg))
    elif isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH:
        log.info("peer %s is gone: dropped %s", peer.hex(), _kind(msg))
    else:
        raise exc
    return False


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
