"""The hub's ZAP handler (its own thread): approves every handshake, CURVE and plain text alike,
with a routing id of the hub's choosing, and holds the socket to :class:`ConnectionLimits`.

Server side only. Split from :mod:`starsd.hub.auth` (the allow-list, the CURVE server setup and
the plain-text guard), whose :class:`~starsd.hub.auth.AllowList` it consults on CURVE
handshakes. Why this handler exists and what it measured: :class:`Authenticator`.
"""

from __future__ import annotations

import heapq
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from starsd.hub.auth import ZAP_DOMAIN, AllowList
from starsd.logsafe import Throttle, printable

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- ZAP handler

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ROUTING_ID_BYTES = 16
"""Length of the routing ids the ZAP handler assigns (random; libzmq's own are 5 bytes)."""
ZAP_REPLY_DELAY_S = 0.02
"""An approval is sent this long after the request; see :class:`Authenticator`."""
HANDSHAKE_MS = 5000
"""The hub socket's ``HANDSHAKE_IVL``: libzmq drops a connection whose handshake is not done by
then, so a connection older than this has been authenticated (or is gone)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """How many TCP connections the hub's socket takes: open at once, and accepted within the
    last :data:`HANDSHAKE_MS` (which include every connection still in its handshake, so every
    unauthenticated one), all together and per peer address. A connection over any of them is
    shut down as soon as it is accepted, before its handshake, so it never buffers anything.

    The defaults leave room for the scale benchmark (128 targets on one host, all at once).
    """

    max_connections: int = 1024
    max_per_address: int = 512
    max_new: int = 256
    max_new_per_address: int = 256


DEFAULT_LIMITS = ConnectionLimits()


@dataclass
class GateStats:
    """What the ZAP handler and connection gate did (read by tests and the hub's logs)."""

    approved: int = 0
    denied: int = 0
    refused_connections: int = 0  # shut down at accept: over a ConnectionLimits cap
    open_connections: int = 0


class _Denials:
    """Log lines about refused peers: one per reason per ``interval_s``, with a count."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self._throttle = Throttle(interval_s)

    def __call__(self, reason: str, detail: str, peer: str) -> None:
        held = self._throttle.allow(reason)
        if held is not None:
            more = f" (+{held} more refused)" if held else ""
            log.warning(
                "refused %s from %s: %s%s",
                reason,
                printable(peer, 64),
                printable(detail, 200),
                more,
            )


class Authenticator:
    """The hub's ZAP handler and connection gate, on its own thread; :meth:`stop` it before
    ``ctx.term()`` (after closing the socket it watches).

    **Handshakes (ZAP).** Plain text (``allow`` None): every NULL handshake is approved.
    CURVE: a handshake is approved when the client key is in the :class:`AllowList` (after its
    rate-limited ``maybe_reload()``); every other mechanism and every unknown key is refused,
    the refusal logged (throttled, escaped).

    **Routing ids.** Every approval carries ZAP metadata ``Identity`` = 16 random bytes
    (:data:`ROUTING_ID_BYTES`, first byte non-zero), and libzmq makes that the connection's
    routing id, replacing the one the peer chose with ``ZMQ_ROUTING_ID``. Why: a ROUTER's
    automatic ids count up from a start that is the same in every process (glibc ``rand()``
    unseeded), a peer may claim the next ones, and when libzmq 4.3.5 then assigns one of them
    to a newcomer it asserts (``socket_base.cpp:2113``) and the hub dies with SIGABRT. The ZAP
    request cannot help refuse such peers: its identity frame is the *hub socket's own*
    routing id, not the peer's (measured; ``zap_client.cpp`` sends ``options.routing_id``).

    libzmq applies the Identity of whichever of {ZAP reply, peer's handshake metadata} it
    parses last, so the approval is sent :data:`ZAP_REPLY_DELAY_S` after the request: CURVE
    parses the peer's INITIATE metadata right after sending the request, and a libzmq DEALER
    sends its NULL READY at once, so both come first (without the delay a fast reply was read
    first in up to half of the handshakes on this 2-core machine). What stays open: a raw NULL
    client that waits for the hub's READY before sending its own keeps the identity it chooses
    (empty included, which makes libzmq assign an automatic id). The automatic ids are then
    unpredictable only because the hub seeds ``rand()`` (see ``starsd.hub.router``).

    **Connections.** :meth:`watch` attaches a socket monitor: ACCEPTED gives the new
    connection's fd, DISCONNECTED its end. A connection over :class:`ConnectionLimits` is shut
    down (``shutdown(2)`` on its fd; libzmq then sees the peer go) right after it is accepted,
    whatever its mechanism or handshake stage.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        allow: AllowList | None,
        domain: str = ZAP_DOMAIN,
        limits: ConnectionLimits = DEFAULT_LIMITS,
        reply_delay_s: float = ZAP_REPLY_DELAY_S,
    ) -> None:
        self.allow = allow
        self.domain = domain
        self.limits = limits
        self.reply_delay_s = reply_delay_s
        self.stats = GateStats()
        self._ctx: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying)  # plain sync sockets
        self._control: zmq.Socket[Any] | None = None
        self._thread: threading.Thread | None = None
        self._adopt: list[zmq.Socket[Any]] = []  # monitors for the thread to take
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._denied = _Denials(interval_s=1.0)

    def start(self) -> None:
        """Bind the context's ZAP endpoint and start answering (once per context: a second
        raises ``zmq.ZMQError``, EADDRINUSE)."""
        zap = self._ctx.socket(zmq.ROUTER)  # ROUTER, not REP: delayed replies interleave
        zap.setsockopt(zmq.LINGER, 0)
        control_addr = f"inproc://starsd.zap-control.{id(self):x}"
        control = self._ctx.socket(zmq.PAIR)
        control.setsockopt(zmq.LINGER, 0)
        try:
            zap.bind(ZAP_ENDPOINT)
            control.bind(control_addr)
            worker_end = self._ctx.socket(zmq.PAIR)
            worker_end.setsockopt(zmq.LINGER, 0)
            worker_end.connect(control_addr)
        except BaseException:
            zap.close()
            control.close()
            raise
        self._control = control
        self._thread = threading.Thread(
            target=self._run, args=(zap, worker_end), name="starsd-zap", daemon=True
        )
        self._thread.start()
        self._started.wait(10)
        _RUNNING[self._ctx.underlying] = self
        if self.allow is not None:
            log.info(
                "CURVE authenticator running (ZAP domain %r, %d allowed keys in %s)",
                self.domain,
                len(self.allow),
                self.allow.directory,
            )

    def watch(self, sock: zmq.Socket[Any]) -> None:
        """Count ``sock``'s connections and hold them to the limits. Call before ``bind``, on
        the thread that owns ``sock``."""
        assert self._control is not None, "start() first"
        addr = f"inproc://starsd.monitor.{id(self):x}.{id(sock):x}"
        sock.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        mon = self._ctx.socket(zmq.PAIR)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(addr)  # before bind: no ACCEPTED event can go out with nobody listening
        with self._lock:
            self._adopt.append(mon)
        self._control.send(b"WATCH")

    def stop(self) -> None:
        """Stop the thread and close its sockets; idempotent."""
        if self._control is None:
            return
        if _RUNNING.get(self._ctx.underlying) is self:
            del _RUNNING[self._ctx.underlying]
        self._control.send(b"STOP")
        if self._thread is not None:
            self._thread.join(10)
        self._control.close()
        self._control = None
        with self._lock:
            for mon in self._adopt:
                mon.close()
            self._adopt.clear()

    @property
    def running(self) -> bool:
        """True while the ZAP thread is answering."""
        return self._control is not None and self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Authenticator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the thread

    def _run(self, zap: zmq.Socket[Any], control: zmq.Socket[Any]) -> None:
        loop = _GateLoop(self, zap, control)
        self._started.set()
        try:
            loop.run()
        except Exception:  # never silently: every later handshake would wait for nothing
            log.exception("ZAP thread failed; handshakes will fail until the hub restarts")
        finally:
            loop.close()

    def decide(
        self, mechanism: bytes, credentials: list[bytes], domain: str, address: str
    ) -> tuple[bool, bytes]:
        """(approved, user id) for one ZAP request; never raises."""
        try:
            if domain != self.domain:
                self._denied("handshake", f"ZAP domain {domain!r}", address)
                return False, b""
            if self.allow is None:
                if mechanism == b"NULL":
                    return True, b""
                self._denied("handshake", f"{mechanism!r} on a plain-text hub", address)
                return False, b""
            if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
                self._denied("handshake", f"{mechanism!r} on a CURVE hub", address)
                return False, b""
            self.allow.maybe_reload()  # a handshake never relies on a list older than that
            key = z85.encode(credentials[0])
            if self.allow.is_allowed(key):
                return True, key
            self._denied(
                "CURVE handshake",
                f"key {key.decode()} not in allow dir {self.allow.directory}",
                address,
            )
        except Exception:  # an exception would end the thread and stall all handshakes
            log.exception("ZAP check failed; refusing")
        return False, b""


class _GateLoop:
    """The ZAP thread's state: pending replies, monitors, open connections."""

    RECONCILE_S = 1.0

    def __init__(
        self, owner: Authenticator, zap: zmq.Socket[Any], control: zmq.Socket[Any]
    ) -> None:
        self.owner = owner
        self.zap = zap
        self.control = control
        self.poller = zmq.Poller()
        self.poller.register(zap, zmq.POLLIN)
        self.poller.register(control, zmq.POLLIN)
        self.monitors: list[zmq.Socket[Any]] = []
        self.pending: list[tuple[float, int, list[bytes]]] = []  # (due, seq, reply) heap
        self.seq = 0
        self.conns: dict[int, tuple[str, int, int]] = {}  # fd -> (address, its port, ours)
        self.per_address: dict[str, int] = {}
        self.recent: deque[tuple[float, str]] = deque()  # (accepted at, address), oldest first
        self.refusals = Throttle(1.0)
        self.next_reconcile = time.monotonic() + self.RECONCILE_S

    def run(self) -> None:
        while True:
            now = time.monotonic()
            due = min([self.next_reconcile] + [p[0] for p in self.pending[:1]])
            events = dict(self.poller.poll(max(0, int(1000 * (due - now)) + 1)))
            self.drain_monitors()  # before any ZAP request: counts include the newcomers
            if self.control in events:
                command = self.control.recv()
                if command == b"STOP":
                    return
                self.adopt_monitors()
            if self.zap in events:
                self.drain_requests()
            self.send_due()
            if time.monotonic() >= self.next_reconcile:
                self.reconcile()
                self.next_reconcile = time.monotonic() + self.RECONCILE_S

    def close(self) -> None:
        for mon in self.monitors:
            mon.close()
        self.zap.close()
        self.control.close()

    # ---------------------------------------------------------------- ZAP

    def drain_requests(self) -> None:
        while True:
            try:
                frames = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.answer(frames)

    def answer(self, frames: list[bytes]) -> None:
        # [envelope, b"", version, request id, domain, address, identity, mechanism, creds...]
        if len(frames) < 8 or frames[1] != b"" or frames[2] != b"1.0":
            if len(frames) >= 4:
                self.zap.send_multipart(
                    [frames[0], b"", b"1.0", frames[3], b"400", b"malformed ZAP request", b"", b""]
                )
            return
        envelope, request_id = frames[0], frames[3]
        domain = frames[4].decode("utf-8", "replace")
        address = frames[5].decode("utf-8", "replace")
        ok, user = self.owner.decide(frames[7], frames[8:], domain, address)
        owner = self.owner
        if not ok:
            owner.stats.denied += 1
            self.zap.send_multipart(
                [envelope, b"", b"1.0", request_id, b"400", b"refused", b"", b""]
            )
            return
        owner.stats.approved += 1
        metadata = _property(b"Identity", new_routing_id())
        reply = [envelope, b"", b"1.0", request_id, b"200", b"OK", user, metadata]
        self.seq += 1
        heapq.heappush(self.pending, (time.monotonic() + owner.reply_delay_s, self.seq, reply))

    def send_due(self) -> None:
        now = time.monotonic()
        while self.pending and self.pending[0][0] <= now:
            _, _, reply = heapq.heappop(self.pending)
            self.zap.send_multipart(reply)

    # ---------------------------------------------------------------- connections

    def adopt_monitors(self) -> None:
        with self.owner._lock:
            adopted, self.owner._adopt = self.owner._adopt, []
        for mon in adopted:
            self.monitors.append(mon)
            self.poller.register(mon, zmq.POLLIN)

    def drain_monitors(self) -> None:
        for mon in self.monitors:
            while True:
                try:
                    raw = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(raw) != 2 or len(raw[0]) != 6:
                    continue
                event, value = struct.unpack("=hi", raw[0])
                if event == zmq.EVENT_ACCEPTED:
                    self.accepted(value, _port_of(raw[1]))
                elif event == zmq.EVENT_DISCONNECTED:
                    self.forget(value)
        self.owner.stats.open_connections = len(self.conns)

    def accepted(self, fd: int, port: int) -> None:
        self.forget(fd)  # an fd number libzmq reused before we saw its DISCONNECTED
        peer = _peer_of(fd, port)
        if peer is None:  # already gone (or not ours any more): its DISCONNECTED follows
            return
        address = peer[0]
        over = self.over_limits(address)
        if over:
            _shut(fd)
            self.owner.stats.refused_connections += 1
            held = self.refusals.allow("connection")
            if held is not None:
                log.warning(
                    "refused a connection from %s: %s%s",
                    printable(address, 64),
                    over,
                    f" (+{held} more refused)" if held else "",
                )
            return
        self.conns[fd] = (address, peer[1], port)
        self.per_address[address] = self.per_address.get(address, 0) + 1
        self.recent.append((time.monotonic(), address))

    def over_limits(self, address: str) -> str:
        """Why a new connection from ``address`` is one too many ('' if it is not)."""
        limits = self.owner.limits
        horizon = time.monotonic() - HANDSHAKE_MS / 1000
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()
        new_here = sum(1 for _, a in self.recent if a == address)
        checks = (
            (len(self.conns), limits.max_connections, "open connections"),
            (self.per_address.get(address, 0), limits.max_per_address, "open from this address"),
            (len(self.recent), limits.max_new, f"accepted in {HANDSHAKE_MS} ms"),
            (new_here, limits.max_new_per_address, f"accepted from it in {HANDSHAKE_MS} ms"),
        )
        return ", ".join(f"{n} {what} (limit {cap})" for n, cap, what in checks if n >= cap)

    def forget(self, fd: int) -> None:
        peer = self.conns.pop(fd, None)
        if peer is not None:
            left = self.per_address.get(peer[0], 1) - 1
            if left > 0:
                self.per_address[peer[0]] = left
            else:
                self.per_address.pop(peer[0], None)

    def reconcile(self) -> None:
        """Drop connections whose fd no longer is what it was (a lost DISCONNECTED event)."""
        for fd, (address, remote_port, port) in list(self.conns.items()):
            if _peer_of(fd, port) != (address, remote_port):
                self.forget(fd)
        self.owner.stats.open_connections = len(self.conns)


def new_routing_id() -> bytes:
    """A routing id for one connection: 16 random bytes, the first non-zero (libzmq reserves
    ids that start with a zero byte for its own)."""
    rid = bytearray(os.urandom(ROUTING_ID_BYTES))
    rid[0] = rid[0] or 1
    return bytes(rid)


def _property(name: bytes, value: bytes) -> bytes:
    """One ZMTP/ZAP metadata property: name length, name, 4-byte value length, value."""
    return bytes((len(name),)) + name + struct.pack(">I", len(value)) + value


def _port_of(endpoint: bytes) -> int:
    """The port of a monitor event's endpoint, ``tcp://host:port`` (0 if there is none)."""
    port = endpoint.rsplit(b":", 1)[-1]
    return int(port) if port.isdigit() else 0


def _peer_of(fd: int, local_port: int) -> tuple[str, int] | None:
    """(address, port) of the TCP peer on ``fd``, without taking ``fd`` over; None when ``fd``
    is no longer a connected TCP socket (or not one accepted on ``local_port``)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if sock.getsockname()[1] != local_port:
            return None
        peer = sock.getpeername()
        return str(peer[0]), int(peer[1])
    except OSError:
        return None
    finally:
        sock.detach()  # the fd stays libzmq's


def _shut(fd: int) -> None:
    """Shut a connection down under libzmq (which then sees the peer go and closes the fd)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


CurveAuthenticator = Authenticator
"""The name the hub and the tests knew it by when it only did CURVE."""

_RUNNING: dict[int, Authenticator] = {}  # context address -> its running handler


def running_on(ctx: zmq.Context[Any]) -> Authenticator | None:
    """The handler :func:`start_authenticator` installed on ``ctx`` and not stopped yet."""
    return _RUNNING.get(ctx.underlying)


def start_authenticator(
    ctx: zmq.Context[Any],
    allow: AllowList | None,
    *,
    domain: str = ZAP_DOMAIN,
    limits: ConnectionLimits = DEFAULT_LIMITS,
) -> Authenticator:
    """Install the hub's ZAP handler on ``ctx``: CURVE with the keys in ``allow``, or plain
    text (NULL) when ``allow`` is None.

    Call it before binding the server socket (a handshake that arrives first is refused, since
    the server socket enforces ZAP). One per context: a second raises ``zmq.ZMQError``
    (EADDRINUSE on ``inproc://zeromq.zap.01``).
    """
    auth = Authenticator(ctx, allow, domain, limits)
    auth.start()
    return auth
