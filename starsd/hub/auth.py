"""The hub's key checks: the allow-list, the CURVE server socket setup, the per-message identity
and the plain-text guard. The ZAP handler that consults the allow-list at each handshake (and
assigns routing ids, and holds the connection limits) is :mod:`starsd.hub.gate`.

Server side only: the hub uses it, the targets never import it (their side is
:mod:`starsd.curve_client`; key files, shared by both, are :mod:`starsd.keys`).

Two checks on keys, because ZAP only runs at the handshake:

1. At the handshake, the ZAP handler (:func:`starsd.hub.gate.start_authenticator`) refuses any
   client key that is not in the :class:`AllowList`; such a client never gets a message through.
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

import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from starsd.keys import PUBLIC_SUFFIX, KeyFileError, load_certificate, load_keypair

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
        log.info(
            "allow list %s: %d keys (added %s; removed %s)",
            self.directory,
            len(self._keys),
            added or "none",
            removed or "none",
        )
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
                log.warning(
                    "allow list: %s contains a SECRET key; it belongs on the target "
                    "only. Using its public half.",
                    path,
                )
            names[public.decode("ascii")] = path.name.removesuffix(PUBLIC_SUFFIX)
        return names


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
    message = (
        f"plain text (no CURVE) on {endpoint}, which other machines can reach: anyone "
        "who can connect can read and send StarSD traffic"
    )
    if not allow_insecure:
        raise InsecureEndpointError(message + "; use --curve-secret and --allow-dir")
    log.warning(message)
