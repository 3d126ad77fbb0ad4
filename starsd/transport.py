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


def router(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    """The hub's ROUTER socket, bound to ``endpoint``."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH/EAGAIN instead of a silent drop
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_MSG_BYTES)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.bind(endpoint)
    return sock


def dealer(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    """A target's DEALER socket connected to the hub at ``endpoint`` (routing id set by hub)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_MSG_BYTES)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.connect(endpoint)
    return sock


def bound_endpoint(sock: zmq.asyncio.Socket) -> str:
    """The endpoint a socket actually bound (resolves port 0 / wildcard binds)."""
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


async def drain_router(sock: zmq.asyncio.Socket, limit: int = 1024) -> list[Received]:
    """Wait for input, then take every message already queued (up to ``limit``) without waiting.

    Draining instead of awaiting each message keeps per-message overhead low on a busy hub.
    """
    await sock.poll()  # POLLIN
    batch: list[Received] = []
    while len(batch) < limit:
        try:
            frames = await sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
        if len(frames) < 2:  # ROUTER always prepends the routing id; anything else is noise
            continue
        batch.append(Received(peer=bytes(frames[0].buffer), frames=list(frames[1:])))
    return batch


def send_to(sock: zmq.asyncio.Socket, peer: bytes, msg: protocol.Message) -> bool:
    """Send ``msg`` to ``peer`` without blocking; False (and a log line) if it cannot go now."""
    # On a zmq.asyncio socket a NOBLOCK send completes at once and reports failure through
    # the returned future, not by raising.
    frames = [peer, *protocol.encode(msg)]
    sent: Any = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
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
