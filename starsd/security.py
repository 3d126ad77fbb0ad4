"""CURVE encryption and key-based authentication for the hub/target link.

Keys are pyzmq certificate files (``zmq.auth.create_certificates``): ``NAME.key`` holds a public
key, ``NAME.key_secret`` the key pair (mode 0600). The hub has one key pair; each target has its
own; the hub's allow-list is a directory of the targets' public ``.key`` files.

Two checks, because ZAP only runs at the handshake:

1. At the handshake, a ZAP handler (:func:`start_authenticator`) refuses any client key that is not
   in the :class:`AllowList`; such a client never gets a message through.
2. On every message, the hub reads the authenticated key from the frame (:func:`user_id`) and asks
   the *current* :class:`AllowList` (:meth:`AllowList.is_allowed`). A key removed from the allow
   directory while its connection is open is refused at its next message.

Which ZAP handler: pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator`, not the
``AsyncioAuthenticator``. Both answered correctly on a ``zmq.asyncio.Context`` under uvloop
(measured), but the thread version

* answers handshakes on its own thread, so a busy or blocked hub event loop does not stall
  handshakes (and handshakes never take turns with message draining on the hub loop);
* starts and stops with plain synchronous calls, with no running loop required
  (``AsyncioAuthenticator.start`` schedules a task on the current loop and its ``stop`` cancels
  that task without awaiting it);
* is independent of which loop implementation the process runs.

Its price: the key check runs on the ZAP thread, so :class:`AllowList` publishes its keys as an
immutable ``frozenset`` swapped in one assignment (atomic under the GIL), and the check callback
never raises (an exception would kill the ZAP thread and stall every later handshake).

Measured with pyzmq 27.3 / libzmq 4.3.5 (see also docs in SECURITY.md):

* Without any ZAP handler on the context a CURVE server accepts EVERY client key. The server
  sockets here therefore set ``ZAP_ENFORCE_DOMAIN`` (settable although ``zmq.has("draft")`` is
  False): with no handler running, every handshake then fails instead of passing.
* ``configure_curve*(domain="*")`` only matches the EMPTY ZAP domain; this module registers the
  explicit domain :data:`ZAP_DOMAIN` and sets the same one on the server socket.
* A rejected client receives nothing; its socket monitor reports HANDSHAKE_FAILED_AUTH (value 400)
  once and libzmq does NOT reconnect. A client without CURVE sees HANDSHAKE_FAILED_PROTOCOL
  (ZMTP mechanism mismatch), also once. A client holding the wrong hub public key sees
  HANDSHAKE_FAILED_NO_DETAIL and then reconnects every ~100 ms, failing each time.
* ``zmq.auth.create_certificates`` writes the secret file with the process umask (0644 here);
  :func:`generate_keypair` writes it 0600 instead.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("starsd.security")

ZAP_DOMAIN = "starsd"
"""The ZAP domain the hub's server socket uses and the authenticator answers for."""

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
SECRET_MODE = 0o600
PUBLIC_MODE = 0o644
Z85_KEY_LEN = 40  # a 32-byte CURVE key in z85
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


# ---------------------------------------------------------------------------------- errors


class KeyFileError(ValueError):
    """A key file is missing, malformed, or of the wrong kind (public vs secret)."""


class InsecureEndpointError(ValueError):
    """Plain text was requested on an endpoint other peers can reach."""


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


# ---------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class CurveServerConfig:
    """Hub side: its key pair file and the directory of allowed target public keys."""

    secret_key_file: Path
    allow_dir: Path


@dataclass(frozen=True)
class CurveClientConfig:
    """Target side: its key pair file and the hub's public key file."""

    secret_key_file: Path
    server_public_key_file: Path


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both halves z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes


@dataclass(frozen=True)
class KeyInfo:
    """What ``starsd keys list`` reports for one key name in a directory."""

    name: str
    public_key: str | None
    public_file: Path | None
    secret_file: Path | None
    secret_mode: int | None
    problem: str | None = None


# ---------------------------------------------------------------------------------- key files


def validate_name(name: str) -> str:
    """Return ``name`` if it is a safe key name (letters, digits, ``._-``; no path parts)."""
    if not _NAME_RE.fullmatch(name):
        raise KeyFileError(
            f"invalid key name {name!r}: use letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit, at most 100 characters)"
        )
    return name


def key_paths(directory: Path, name: str) -> tuple[Path, Path]:
    """``(public, secret)`` file paths for key ``name`` in ``directory``."""
    validate_name(name)
    return directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"


def generate_keypair(directory: Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600) into ``directory``.

    The pair is made by ``zmq.auth.create_certificates`` inside a private (0700) temporary
    directory next to the destination, given its final modes there, then linked into place: the
    secret is never readable by others, and without ``force`` an existing file is never
    replaced (``FileExistsError``), even by a concurrent writer.
    """
    public_dst, secret_dst = key_paths(directory, name)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not force:
        existing = [p for p in (public_dst, secret_dst) if p.exists()]
        if existing:
            verb = "exists" if len(existing) == 1 else "exist"
            names = " and ".join(map(str, existing))
            raise FileExistsError(f"{names} already {verb}; use --force to replace")
    with tempfile.TemporaryDirectory(prefix=".starsd-keys-", dir=directory) as tmp:
        public_src, secret_src = (Path(p) for p in zmq.auth.create_certificates(tmp, name))
        os.chmod(secret_src, SECRET_MODE)
        os.chmod(public_src, PUBLIC_MODE)
        _install(secret_src, secret_dst, force=force)
        try:
            _install(public_src, public_dst, force=force)
        except FileExistsError:
            secret_dst.unlink()  # lost a race on the public half: leave no orphan secret
            raise
    return public_dst, secret_dst


def _install(src: Path, dst: Path, *, force: bool) -> None:
    if force:
        os.replace(src, dst)
    else:
        os.link(src, dst)  # atomic, and fails if dst exists


def load_keypair(path: Path) -> KeyPair:
    """Load a secret certificate (``NAME.key_secret``); checks both halves belong together."""
    public, secret = _load_certificate(path)
    if secret is None:
        raise KeyFileError(
            f"{path} holds only a public key; pass the secret file (NAME{SECRET_SUFFIX})"
        )
    _check_z85_key(path, secret)
    if zmq.curve_public(secret) != public:
        raise KeyFileError(f"{path}: public and secret key do not belong together")
    _warn_if_exposed(path)
    return KeyPair(public=public, secret=secret)


def load_public_key(path: Path, *, warn_if_secret: bool = True) -> bytes:
    """Load the z85 public key from a certificate file (a public or a secret one).

    A file that also holds a secret key is logged as a warning (it was handed to the wrong
    side) unless ``warn_if_secret`` is False.
    """
    public, secret = _load_certificate(path)
    if secret is not None and warn_if_secret:
        log.warning("%s contains a SECRET key; only its public half is used here. Give this "
                    "side the public file (NAME%s) instead.", path, PUBLIC_SUFFIX)  # fmt: skip
    return public


def _load_certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc}") from exc
    except ValueError as exc:
        raise KeyFileError(f"{path} is not a ZeroMQ certificate: {exc}") from exc
    _check_z85_key(path, public)
    return public, secret


def _check_z85_key(path: Path, key: bytes) -> None:
    try:
        ok = len(key) == Z85_KEY_LEN and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise KeyFileError(f"{path}: not a valid z85 CURVE key ({len(key)} characters)")


def _warn_if_exposed(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("secret key file %s has mode %04o: others may read it (chmod 600 %s)",
                    path, mode, path)  # fmt: skip


def list_keys(directory: Path) -> list[KeyInfo]:
    """Every key name in ``directory`` with its public key and whether a secret file exists."""
    suffixes = (PUBLIC_SUFFIX, SECRET_SUFFIX)
    names = sorted({p.name.removesuffix(SECRET_SUFFIX).removesuffix(PUBLIC_SUFFIX)
                    for p in directory.iterdir()
                    if p.is_file() and p.name.endswith(suffixes)})  # fmt: skip
    return [_key_info(directory, name) for name in names]


def _key_info(directory: Path, name: str) -> KeyInfo:
    public_file = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_file = directory / f"{name}{SECRET_SUFFIX}"
    pub_path = public_file if public_file.is_file() else None
    sec_path = secret_file if secret_file.is_file() else None
    mode = stat.S_IMODE(sec_path.stat().st_mode) if sec_path else None
    public_key: str | None = None
    problem: str | None = None
    try:
        keys = [_load_certificate(p)[0] for p in (pub_path, sec_path) if p is not None]
        public_key = keys[0].decode("ascii")
        if len(set(keys)) > 1:
            problem = "public and secret files hold different keys"
    except KeyFileError as exc:
        problem = str(exc)
    if problem is None and mode is not None and mode & 0o077:
        problem = f"secret file mode {mode:04o} is readable by others"
    return KeyInfo(name, public_key, pub_path, sec_path, mode, problem)


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
                public, secret = _load_certificate(path)
            except KeyFileError as exc:
                log.warning("allow list: skipping %s", exc)
                continue
            if secret is not None:
                log.warning("allow list: %s contains a SECRET key; it belongs on the target "
                            "only. Using its public half.", path)  # fmt: skip
            names[public.decode("ascii")] = path.name.removesuffix(PUBLIC_SUFFIX)
        return names


# ---------------------------------------------------------------------------------- ZAP handler


class _AllowListProvider:
    """``configure_curve_callback`` provider: asks the live AllowList; never raises."""

    def __init__(self, allow: AllowList, on_denied: Callable[[str], None]) -> None:
        self.allow = allow
        self.on_denied = on_denied

    def callback(self, domain: str, key: bytes) -> bool:
        """Called on the ZAP thread with the client's z85 public key."""
        try:
            self.allow.maybe_reload()  # a handshake never relies on a list older than the interval
            user = key.decode("ascii", "replace")
            if self.allow.is_allowed(user):
                return True
            self.on_denied(user)
        except Exception:  # an exception would kill the ZAP thread and stall all handshakes
            log.exception("ZAP check failed; refusing the key")
        return False


class _DenialLog:
    """At most one 'refused key' line per ``interval_s``; counts the suppressed ones."""

    def __init__(self, directory: Path, interval_s: float = 1.0) -> None:
        self.directory = directory
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._suppressed = 0

    def __call__(self, user: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._suppressed += 1
                return
            self._next = now + self.interval_s
            suppressed, self._suppressed = self._suppressed, 0
        more = f" (+{suppressed} more refused)" if suppressed else ""
        log.warning("refused CURVE handshake from key %s: not in allow dir %s%s",
                    user, self.directory, more)  # fmt: skip


class CurveAuthenticator:
    """A running ZAP handler on one context; :meth:`stop` it before ``ctx.term()``.

    It consults the :class:`AllowList` object on every handshake (after its rate-limited
    ``maybe_reload()``), so a changed allow directory or an ``allow.reload()`` takes effect for
    the next handshake with nothing else to update.
    """

    def __init__(self, ctx: zmq.Context[Any], allow: AllowList, domain: str) -> None:
        self.allow = allow
        self.domain = domain
        self._auth: ThreadAuthenticator | None = ThreadAuthenticator(
            ctx, log=logging.getLogger("starsd.security.zap")
        )

    def start(self) -> None:
        """Bind the context's ZAP endpoint and start answering (once per context)."""
        assert self._auth is not None, "authenticator already stopped"
        try:
            self._auth.start()
        except BaseException:
            self.stop()  # a half-started handler's ZAP socket would keep ctx.term() waiting
            raise
        provider = _AllowListProvider(self.allow, _DenialLog(self.allow.directory))
        self._auth.configure_curve_callback(domain=self.domain, credentials_provider=provider)
        log.info("CURVE authenticator running (ZAP domain %r, %d allowed keys in %s)",
                 self.domain, len(self.allow), self.allow.directory)  # fmt: skip

    def stop(self) -> None:
        """Stop the ZAP thread and close its sockets; idempotent."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    @property
    def running(self) -> bool:
        """True while the ZAP thread is answering."""
        return self._auth is not None and self._auth.is_alive()

    def __enter__(self) -> CurveAuthenticator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_authenticator(
    ctx: zmq.Context[Any], allow: AllowList, *, domain: str = ZAP_DOMAIN
) -> CurveAuthenticator:
    """Install a ZAP handler on ``ctx`` that accepts exactly the keys in ``allow``.

    Call it before binding the server socket (a handshake that arrives first is refused, since
    :func:`secure_server` enforces ZAP). One per context: a second raises ``zmq.ZMQError``
    (EADDRINUSE on ``inproc://zeromq.zap.01``).
    """
    auth = CurveAuthenticator(ctx, allow, domain)
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


def secure_client(sock: zmq.Socket[Any], cfg: CurveClientConfig) -> str:
    """Make ``sock`` a CURVE client of the hub whose public key is given; returns its own
    public key (z85), the User-Id the hub will see. Call BEFORE ``connect``."""
    pair = load_keypair(cfg.secret_key_file)
    server_key = load_public_key(cfg.server_public_key_file)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
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
        return (f"the hub refused this key (ZAP status {value}): its public .key file is not in "
                "the hub's allow dir, or was removed")  # fmt: skip
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (f"protocol error {_event_name(value)}; a mechanism mismatch means one side uses "
                "CURVE and the other plain text")  # fmt: skip
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (f"the hub closed the handshake (errno {value}): wrong hub public key, or the "
                "hub has no authenticator running")  # fmt: skip
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
