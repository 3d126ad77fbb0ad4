"""The hub's gatekeeping: the allow-list, the ZAP handler (CURVE and plain text alike), the
connection limits and the server socket setup.

Server side only: the hub uses it, the targets never import it (their side is
:mod:`starsd.curve_client`; key files, shared by both, are :mod:`starsd.keys`).

Two checks on keys, because ZAP only runs at the handshake:

1. At the handshake, the ZAP handler (:func:`start_authenticator`) refuses any client key that is
   not in the :class:`AllowList`; such a client never gets a message through.
2. On every message, the hub reads the authenticated key from the frame (:func:`user_id`) and asks
   the *current* :class:`AllowList` (:meth:`AllowList.is_allowed`). A key removed from the allow
   directory while its connection is open is refused at its next message.

The same handler runs in plain text (NULL mechanism, every handshake approved), because it also
assigns every connection its routing id and holds the socket to :class:`ConnectionLimits`; see
:class:`Authenticator` for why and for what it cannot close.

The handler is our own thread (a ROUTER on the ZAP endpoint, so approvals can be delayed
without holding up other handshakes; pyzmq's ``ThreadAuthenticator`` answers from a REP socket,
strictly in order). On its own thread a busy or blocked hub event loop does not stall handshakes,
and it starts and stops with plain synchronous calls. Its price: the key check runs on the ZAP
thread, so :class:`AllowList` publishes its keys as an immutable ``frozenset`` swapped in one
assignment (atomic under the GIL), and the checks never raise (an exception would end the ZAP
thread and stall every later handshake).

Measured with pyzmq 27.3 / libzmq 4.3.5 (see also docs in SECURITY.md):

* Without any ZAP handler on the context a CURVE server accepts EVERY client key. The server
  sockets here therefore set ``ZAP_ENFORCE_DOMAIN`` (settable although ``zmq.has("draft")`` is
  False): with no handler running, every handshake then fails instead of passing.
* ``configure_curve*(domain="*")`` only matches the EMPTY ZAP domain; this module uses the
  explicit domain :data:`ZAP_DOMAIN` and sets the same one on the server socket.
* A ZAP request's identity frame is the server socket's own routing id, not the peer's.
* What a refused client sees is described in :mod:`starsd.curve_client`.

The plain-text guard (:func:`check_plaintext_endpoint`, :func:`is_loopback`) lives here too: only
the hub binds, so only the hub decides whether its endpoint may go without CURVE.
"""

from __future__ import annotations

import heapq
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from starsd.keys import PUBLIC_SUFFIX, KeyFileError, load_certificate, load_keypair
from starsd.logsafe import Throttle, printable

log = logging.getLogger(__name__)

ZAP_DOMAIN = "starsd"
"""The ZAP domain the hub's server socket uses and the authenticator answers for."""


# ---------------------------------------------------------------------------------- errors


class InsecureEndpointError(ValueError):
    """Plain text was requested on an endpoint other peers can reach."""


# ---------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class CurveServerConfig:
    """Hub side: its key pair file and the directory of allowed target public keys."""

    secret_key_file: Path
    allow_dir: Path


# ---------------------------------------------------------------------------------- allow-list


class AllowList:
    """The public keys (z85 text) of the targets allowed to connect: the ``*.key`` files of a dir.

    ``reload()`` re-reads the directory (call it on SIGHUP); ``maybe_reload()`` does so only when
    the directory's listing or a key file's metadata changed, and looks at most once per
    ``check_interval_s`` (cheap enough to call on every message batch). A directory that
    disappears or cannot be read empties the list: the hub fails closed.

    Thread-safe: readers see an immutable frozenset replaced in one assignment; reloads (from the
    hub loop, a SIGHUP handler or the ZAP thread) are serialised by a lock.
    """

    def __init__(
        self,
        directory: Path,
        *,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not directory.is_dir():
            raise KeyFileError(f"allow directory {directory} does not exist or is not a directory")
        self.directory = directory
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._names: dict[str, str] = {}
        self._keys: frozenset[str] = frozenset()
        self._signature: tuple[object, ...] | None = None
        self._next_check = 0.0
        self._lock = threading.Lock()
        self.reload()

    @property
    def keys(self) -> frozenset[str]:
        """The allowed z85 public keys now."""
        return self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def is_allowed(self, user_id: str | bytes | None) -> bool:
        """True if ``user_id`` (a z85 public key, e.g. from :func:`user_id`) is allowed now."""
        if isinstance(user_id, bytes):
            user_id = user_id.decode("ascii", "replace")
        return user_id is not None and user_id in self._keys

    def name_of(self, user_id: str | None) -> str | None:
        """The key file name (without ``.key``) an allowed key was loaded from, for logs."""
        return self._names.get(user_id) if user_id is not None else None

    def reload(self) -> bool:
        """Re-read the directory now; True if the set of allowed keys changed."""
        with self._lock:
            return self._reload_locked()

    def _reload_locked(self) -> bool:
        self._signature = self._scan_signature()
        names = self._read_keys()
        old, old_names = self._keys, self._names
        self._names = names
        self._keys = frozenset(names)  # the one assignment readers see
        self._next_check = self._clock() + self.check_interval_s
        if old == self._keys:
            log.debug("allow list %s unchanged (%d keys)", self.directory, len(self._keys))
            return False
        added = sorted(names[k] for k in self._keys - old)
        removed = sorted(old_names[k] for k in old - self._keys)
        log.info("allow list %s: %d keys (added %s; removed %s)", self.directory,
                 len(self._keys), added or "none", removed or "none")  # fmt: skip
        return True

    def maybe_reload(self) -> bool:
        """Reload if the directory changed since the last look (checked at most once per
        ``check_interval_s``); True if the set of allowed keys changed."""
        if self._clock() < self._next_check:  # the cheap path: no lock, no system call
            return False
        with self._lock:
            now = self._clock()
            if now < self._next_check:
                return False
            self._next_check = now + self.check_interval_s
            if self._scan_signature() == self._signature:
                return False
            return self._reload_locked()

    def _scan_signature(self) -> tuple[object, ...]:
        """Cheap fingerprint: the directory's mtime plus each key file's identity and mtime."""
        try:
            dir_stat = self.directory.stat()
            with os.scandir(self.directory) as scan:
                files = [(e.name, e.stat()) for e in scan if e.name.endswith(PUBLIC_SUFFIX)]
        except OSError as exc:
            return ("error", str(exc))
        entries = sorted((name, st.st_mtime_ns, st.st_size, st.st_ino) for name, st in files)
        return (dir_stat.st_mtime_ns, dir_stat.st_ino, tuple(entries))

    def _read_keys(self) -> dict[str, str]:
        if not self.directory.is_dir():
            log.error("allow directory %s is gone: allowing NO keys", self.directory)
            return {}
        try:
            files = sorted(p for p in self.directory.glob(f"*{PUBLIC_SUFFIX}") if p.is_file())
        except OSError as exc:
            log.error("cannot read allow directory %s (%s): allowing NO keys", self.directory, exc)
            return {}
        names: dict[str, str] = {}
        for path in files:
            try:
                public, secret = load_certificate(path)
            except KeyFileError as exc:
                log.warning("allow list: skipping %s", exc)
                continue
            if secret is not None:
                log.warning("allow list: %s contains a SECRET key; it belongs on the target "
                            "only. Using its public half.", path)  # fmt: skip
            names[public.decode("ascii")] = path.name.removesuffix(PUBLIC_SUFFIX)
        return names


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
            log.warning("refused %s from %s: %s%s", reason, printable(peer, 64),
                        printable(detail, 200), more)  # fmt: skip


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

    def __init__(self, ctx: zmq.Context[Any], allow: AllowList | None, domain: str = ZAP_DOMAIN,
                 limits: ConnectionLimits = DEFAULT_LIMITS,
                 reply_delay_s: float = ZAP_REPLY_DELAY_S) -> None:  # fmt: skip
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
        self._thread = threading.Thread(target=self._run, args=(zap, worker_end),
                                        name="starsd-zap", daemon=True)  # fmt: skip
        self._thread.start()
        self._started.wait(10)
        _RUNNING[self._ctx.underlying] = self
        if self.allow is not None:
            log.info("CURVE authenticator running (ZAP domain %r, %d allowed keys in %s)",
                     self.domain, len(self.allow), self.allow.directory)  # fmt: skip

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

    def decide(self, mechanism: bytes, credentials: list[bytes], domain: str, address: str
               ) -> tuple[bool, bytes]:  # fmt: skip
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
            self._denied("CURVE handshake", f"key {key.decode()} not in allow dir "
                         f"{self.allow.directory}", address)  # fmt: skip
        except Exception:  # an exception would end the thread and stall all handshakes
            log.exception("ZAP check failed; refusing")
        return False, b""


class _GateLoop:
    """The ZAP thread's state: pending replies, monitors, open connections."""

    RECONCILE_S = 1.0

    def __init__(self, owner: Authenticator, zap: zmq.Socket[Any],
                 control: zmq.Socket[Any]) -> None:  # fmt: skip
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
                self.zap.send_multipart([frames[0], b"", b"1.0", frames[3], b"400",
                                         b"malformed ZAP request", b"", b""])  # fmt: skip
            return
        envelope, request_id = frames[0], frames[3]
        domain = frames[4].decode("utf-8", "replace")
        address = frames[5].decode("utf-8", "replace")
        ok, user = self.owner.decide(frames[7], frames[8:], domain, address)
        owner = self.owner
        if not ok:
            owner.stats.denied += 1
            self.zap.send_multipart([envelope, b"", b"1.0", request_id, b"400", b"refused",
                                     b"", b""])  # fmt: skip
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
                log.warning("refused a connection from %s: %s%s", printable(address, 64), over,
                            f" (+{held} more refused)" if held else "")  # fmt: skip
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
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                  socket.AF_INET6):
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
    ctx: zmq.Context[Any], allow: AllowList | None, *, domain: str = ZAP_DOMAIN,
    limits: ConnectionLimits = DEFAULT_LIMITS,
) -> Authenticator:  # fmt: skip
    """Install the hub's ZAP handler on ``ctx``: CURVE with the keys in ``allow``, or plain
    text (NULL) when ``allow`` is None.

    Call it before binding the server socket (a handshake that arrives first is refused, since
    the server socket enforces ZAP). One per context: a second raises ``zmq.ZMQError``
    (EADDRINUSE on ``inproc://zeromq.zap.01``).
    """
    auth = Authenticator(ctx, allow, domain, limits)
    auth.start()
    return auth


# ---------------------------------------------------------------------------------- sockets


def secure_server(
    sock: zmq.Socket[Any], cfg: CurveServerConfig, *, domain: str = ZAP_DOMAIN
) -> str:
    """Make ``sock`` a CURVE server that requires ZAP approval; returns its public key (z85).

    Call BEFORE ``bind``. ``ZAP_ENFORCE_DOMAIN`` makes every handshake fail if no ZAP handler
    is running, instead of accepting every key.
    """
    pair = load_keypair(cfg.secret_key_file)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    return pair.public.decode("ascii")


def user_id(frame: zmq.Frame) -> str | None:
    """The authenticated peer's z85 public key from a frame received with ``copy=False``.

    None when the connection has no ZAP-approved identity (plain text, or CURVE without ZAP).
    Every frame of a message carries it, including a ROUTER's routing-id frame.
    """
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:  # EINVAL: the property is absent
        return None
    return str(value) or None


def peer_address(frame: zmq.Frame) -> str | None:
    """The peer's IP address from a frame received with ``copy=False`` (for logs)."""
    try:
        return str(frame.get("Peer-Address")) or None
    except zmq.ZMQError:
        return None


# ---------------------------------------------------------------------------------- endpoints


def is_loopback(endpoint: str) -> bool:
    """True if only this machine can reach ``endpoint``.

    ``ipc://`` and ``inproc://`` are; ``tcp://`` is when the host is a loopback address
    (127.0.0.0/8, ``::1``, with or without brackets) or ``localhost``. Wildcards (``*``,
    ``0.0.0.0``), interface names and other host names are not. Other transports are not.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    scheme = scheme.lower()
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(";", 1)[-1]  # "tcp://source;dest": the destination decides
    host = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") else host
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plaintext_endpoint(endpoint: str, *, allow_insecure: bool = False) -> None:
    """Raise InsecureEndpointError for plain text on a non-loopback endpoint.

    With ``allow_insecure`` it only logs a warning instead.
    """
    if is_loopback(endpoint):
        return
    message = (f"plain text (no CURVE) on {endpoint}, which other machines can reach: anyone "
               "who can connect can read and send StarSD traffic")  # fmt: skip
    if not allow_insecure:
        raise InsecureEndpointError(message + "; use --curve-secret and --allow-dir")
    log.warning(message)
