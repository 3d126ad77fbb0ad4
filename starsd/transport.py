"""ZeroMQ transport shared by both sides: context, socket options, DEALER, send/receive, loop.

Frames in, typed messages out (via :mod:`starsd.protocol`); nothing past this module (or the
hub's :mod:`starsd.hub.router`) sees raw frames. Targets use zmq.asyncio DEALERs (:func:`dealer`);
the hub's ROUTER, which builds on the options here, is :mod:`starsd.hub.router`. Both sides run
their loop through :func:`run_loop`. Nothing here imports the hub's side.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from starsd import curve_client, limits, protocol

HEARTBEAT_MS = 1000  # ZMTP heartbeat, where one is asked for: closed after 3 silent intervals
CANCEL_AGAIN_S = 0.1  # cancel_and_wait: a task still running this long is cancelled again
T = TypeVar("T")


def new_context() -> zmq.asyncio.Context:
    """A fresh asyncio ZeroMQ context (one per process or per test)."""
    return zmq.asyncio.Context()


def dealer(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    curve: curve_client.CurveClientConfig | None = None,
    heartbeat_ms: int = 0,
    max_frame_bytes: int = limits.SOCKET_MAX_MSG_BYTES,
) -> tuple[zmq.asyncio.Socket, curve_client.HandshakeWatch | None]:
    """A target's DEALER connected to ``endpoint``; the hub assigns its routing id.

    No ZMTP heartbeats by default: libzmq 4.3.5 aborts the process
    (``_input_stopped``, stream_engine_base.cpp:396) when a heartbeat times out a connection
    whose input is stopped at the high-water mark, which a hub that floods can arrange at will
    (libzmq #3937); the client's own PING / PONG tells a dead hub. With ``curve``, also returns
    a watch on the handshake (attached before connecting): await ``watch.wait()`` so a rejected
    key fails loudly instead of hanging.
    """
    sock = ctx.socket(zmq.DEALER)
    common_options(sock, heartbeat_ms, max_frame_bytes)
    sock.setsockopt(zmq.RCVHWM, limits.TARGET_RCVHWM)
    watch = None
    if curve is not None:
        curve_client.secure_client(sock, curve)
        watch = curve_client.watch_handshake(sock)
    sock.connect(endpoint)
    return sock, watch


def common_options(
    sock: zmq.Socket,
    heartbeat_ms: int = HEARTBEAT_MS,
    max_frame_bytes: int = limits.SOCKET_MAX_MSG_BYTES,
) -> None:
    """The options every StarSD socket gets, DEALER and ROUTER alike: no linger, the frame
    size limit, the high-water marks and (if ``heartbeat_ms`` > 0) ZMTP heartbeats."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.SNDHWM, limits.HWM)
    sock.setsockopt(zmq.RCVHWM, limits.HWM)
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


def send_nowait(sock: zmq.asyncio.Socket, msg: protocol.Message) -> bool:
    """Send ``msg`` on a DEALER without waiting; False (nothing sent) if the peer's queue is full
    (for callbacks that cannot await, and peers that do not read)."""
    try:
        sock.send_multipart(protocol.encode(msg), flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    return True


async def recv(sock: zmq.asyncio.Socket) -> protocol.Message:
    """Receive and decode one message on a DEALER; raises ProtocolError if malformed."""
    frames = await sock.recv_multipart(copy=False)
    return protocol.decode(frames)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again any still running
    a moment later: Python 3.11's ``asyncio.wait_for`` drops a cancel that lands as the future
    it waits on completes, and the task then runs on (a target's liveness loop re-joining a hub
    as its WELCOME came back did, and its client's close waited for good). Their errors are
    taken (not reported as never retrieved)."""
    tasks = list(tasks)
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_AGAIN_S)
    for task in tasks:
        if not task.cancelled():
            task.exception()


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
