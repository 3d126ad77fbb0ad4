"""The target's side of CURVE: encrypt its DEALER and learn the handshake's outcome.

Used by the targets (:mod:`starsd.transport`'s ``dealer``, :mod:`edge.client`), never by the hub;
the hub's side (ZAP authenticator, allow-list) is :mod:`starsd.hub.auth`.

A client cannot ask libzmq whether its handshake passed, so :class:`HandshakeWatch` reads the
socket monitor. Measured with pyzmq 27.3 / libzmq 4.3.5 (see also SECURITY.md):

* A rejected client receives nothing; its socket monitor reports HANDSHAKE_FAILED_AUTH (value 400)
  once and libzmq does NOT reconnect. A client without CURVE sees HANDSHAKE_FAILED_PROTOCOL
  (ZMTP mechanism mismatch), also once. A client holding the wrong hub public key sees
  HANDSHAKE_FAILED_NO_DETAIL and then reconnects every ~100 ms, failing each time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from starsd.keys import load_keypair, load_public_key

# ---------------------------------------------------------------------------------- errors


class HandshakeError(ConnectionError):
    """The connection to the hub did not reach an authenticated, encrypted state."""


class HandshakeRejected(HandshakeError):
    """The hub (or the ZMTP layer) refused the handshake; retrying will not help."""

    def __init__(self, endpoint: str, event: str, detail: str) -> None:
        super().__init__(f"handshake with {endpoint} failed ({event}): {detail}")
        self.endpoint = endpoint
        self.event = event


class HandshakeTimeout(HandshakeError):
    """No handshake outcome within the time allowed (hub down or unreachable?)."""


# ---------------------------------------------------------------------------------- sockets


@dataclass(frozen=True)
class CurveClientConfig:
    """Target side: its key pair file and the hub's public key file."""

    secret_key_file: Path
    server_public_key_file: Path


def secure_client(sock: zmq.Socket[Any], cfg: CurveClientConfig) -> str:
    """Make ``sock`` a CURVE client of the hub whose public key is given; returns its own
    public key (z85), the User-Id the hub will see. Call BEFORE ``connect``."""
    pair = load_keypair(cfg.secret_key_file)
    server_key = load_public_key(cfg.server_public_key_file)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
    return pair.public.decode("ascii")


# ---------------------------------------------------------------------------------- handshake


_WATCH_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_MONITOR_STOPPED
)

_PROGRESS: dict[int, str] = {
    zmq.EVENT_CONNECTED: "TCP connected, handshake pending",
    zmq.EVENT_CONNECT_RETRIED: "connection refused, retrying",
    zmq.EVENT_DISCONNECTED: "disconnected",
}


class HandshakeWatch:
    """Watches one connecting socket's monitor for the outcome of its (CURVE) handshake.

    Create it BEFORE ``connect`` (a handshake on loopback completes in about a millisecond and
    a monitor attached later misses the success), then ``await wait()``::

        watch = HandshakeWatch(sock)
        sock.connect(endpoint)
        await watch.wait(timeout_s=1.0)   # raises HandshakeRejected / HandshakeTimeout

    ``wait`` closes the monitor whatever happens (``disable_monitor`` first, then the monitor
    socket); ``close`` is also safe to call directly and more than once.
    """

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self._mon: zmq.asyncio.Socket | None = sock.get_monitor_socket(_WATCH_EVENTS)
        self._last = "no connection yet"

    async def wait(self, timeout_s: float = 1.0) -> None:
        """Return on HANDSHAKE_SUCCEEDED; raise HandshakeRejected on HANDSHAKE_FAILED_*,
        HandshakeTimeout if neither happens within ``timeout_s``."""
        endpoint = self._endpoint()
        try:
            await asyncio.wait_for(self._until_outcome(endpoint), timeout_s)
        except asyncio.TimeoutError:
            raise HandshakeTimeout(
                f"no handshake with {endpoint} within {timeout_s:g} s ({self._last}); "
                "is the hub running and reachable?"
            ) from None
        finally:
            self.close()

    def close(self) -> None:
        """Stop monitoring: ``disable_monitor`` before closing the monitor socket."""
        if self._mon is None:
            return
        mon, self._mon = self._mon, None
        if not self.sock.closed:
            self.sock.disable_monitor()
        mon.close(linger=0)

    async def _until_outcome(self, endpoint: str) -> None:
        assert self._mon is not None, "HandshakeWatch already closed"
        while True:
            event = parse_monitor_message(await self._mon.recv_multipart())
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            failure = _describe_failure(kind, value)
            if failure is not None:
                raise HandshakeRejected(endpoint, _event_name(kind), failure)
            if kind == zmq.EVENT_MONITOR_STOPPED:
                raise HandshakeError(f"socket to {endpoint} closed during the handshake")
            self._last = _PROGRESS.get(kind, _event_name(kind))

    def _endpoint(self) -> str:
        try:
            return self.sock.getsockopt_string(zmq.LAST_ENDPOINT) or "the hub"
        except zmq.ZMQError:
            return "the hub"


def _describe_failure(kind: int, value: int) -> str | None:
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the hub refused this key (ZAP status {value}): its public .key file is not in "
            "the hub's allow dir, or was removed"
        )
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (
            f"protocol error {_event_name(value)}; a mechanism mismatch means one side uses "
            "CURVE and the other plain text"
        )
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (
            f"the hub closed the handshake (errno {value}): wrong hub public key, or the "
            "hub has no authenticator running"
        )
    return None


def _event_name(value: int) -> str:
    try:
        return str(zmq.Event(value).name)
    except ValueError:
        return str(value)


def watch_handshake(sock: zmq.asyncio.Socket) -> HandshakeWatch:
    """Start watching ``sock``'s handshake; call BEFORE ``connect``. See :class:`HandshakeWatch`."""
    return HandshakeWatch(sock)


async def connect_verified(sock: zmq.asyncio.Socket, endpoint: str, timeout_s: float = 1.0) -> None:
    """``connect`` and wait for the handshake outcome (raises like :meth:`HandshakeWatch.wait`).

    On failure the socket is left connected (libzmq may keep retrying); close it.
    """
    watch = HandshakeWatch(sock)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        watch.close()
        raise
    await watch.wait(timeout_s)
