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

from starsd import protocol

log = logging.getLogger(__name__)

# A frame larger than this makes libzmq drop the connection before any byte reaches us; frames
# between protocol.MAX_FRAME_BYTES and this get a TOO_LARGE error reply instead.
SOCKET_MAX_MSG_BYTES = 4 * protocol.MAX_FRAME_BYTES
HWM = 10_000
T = TypeVar("T")


@dataclass(frozen=True)
class Received:
    """One message from a peer: the peer's routing id ('' on a DEALER) and its frames."""

    peer: bytes
    frames: list[zmq.Frame]


def new_context() -> zmq.asyncio.Context:
    """A fresh asyncio ZeroMQ context (one per process or per test)."""
    return zmq.asyncio.Context()


@dataclass(frozen=True)
class Router:
    """The hub's ROUTER socket: asyncio for waiting, a synchronous shadow for NOBLOCK I/O.

    Both objects wrap the same libzmq socket. Non-blocking receives and sends on the shadow skip
    zmq.asyncio's future machinery (~50 us per call measured on this VM); only waiting for input
    goes through asyncio. Everything runs on the event loop thread, so the socket is never shared
    between threads.
    """

    sock: zmq.asyncio.Socket
    raw: zmq.Socket

    @property
    def endpoint(self) -> str:
        """The endpoint actually bound (port 0 / wildcard resolved)."""
        return bound_endpoint(self.sock)

    def close(self) -> None:
        """Close without lingering."""
        self.sock.close(linger=0)


def router(ctx: zmq.asyncio.Context, endpoint: str) -> Router:
    """The hub's ROUTER socket, bound to ``endpoint``."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH/EAGAIN instead of a silent drop
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_MSG_BYTES)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.bind(endpoint)
    return Router(sock, zmq.Socket.shadow(sock.underlying))


def dealer(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    """A target's DEALER socket connected to the hub at ``endpoint`` (routing id set by hub)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_MSG_BYTES)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.connect(endpoint)
    return sock


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
        batch.append(Received(peer=bytes(frames[0].buffer), frames=list(frames[1:])))
    return batch


def send_to(router: Router, peer: bytes, msg: protocol.Message) -> bool:
    """Send ``msg`` to ``peer`` without blocking; False (and a log line) if it cannot go now."""
    try:
        router.raw.send_multipart([peer, *protocol.encode(msg)], flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        log.warning("peer %s is not reading (HWM reached): dropped %s", peer.hex(), _kind(msg))
        return False
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise
        log.info("peer %s is gone: dropped %s", peer.hex(), _kind(msg))
        return False
    return True


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
