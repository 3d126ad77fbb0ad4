"""The hosts of the LAN benchmark: network namespaces on a bridge, built and torn down.

:class:`Namespaces` builds an emulated LAN: one "hub" and N "target" network namespaces, each
with an ``eth0`` (a veth pair) plugged into a Linux bridge that lives in its own namespace,
addressed from 10.77.0.0/24. Nothing is created in the root namespace and everything is removed
on exit; :func:`cleanup_stale` removes what a killed run left behind.

Used by scripts/emulate/netem.py (``check``, ``cleanup``), scripts/bench/run.py (the LAN suite) and
tests/test_netem.py. Needs Linux, root and iproute2 (:func:`available` says why not).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

log = logging.getLogger("netem")

LAN_PREFIX = "10.77.0"
"""The first three octets of the emulated LAN (a /24); hosts get .1 (hub), .2, .3, ..."""
NS_PREFIX = "starsd"
"""Every namespace this module creates is named ``starsd-<pid>-<token>-<role>``."""
_NS_NAME = re.compile(rf"^{NS_PREFIX}-(\d+)-[0-9a-f]+-")
_IP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Host:
    """One emulated machine: a network namespace with ``eth0`` at ``ip`` on the LAN."""

    role: str  # "hub", "target0", "target1", ...
    netns: str
    ip: str


def _ip(*args: str, timeout_s: float = _IP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise RuntimeError with ip's message on failure."""
    try:
        result = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"ip {' '.join(args)}: {exc}") from exc
    if result.returncode != 0:
        message = result.stderr.strip() or f"exit {result.returncode}"
        raise RuntimeError(f"ip {' '.join(args)}: {message}")
    return result


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_exec_argv(netns: Host | str, argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped to run inside ``netns`` (``ip netns exec`` execs, so the pid is argv's)."""
    name = netns.netns if isinstance(netns, Host) else netns
    return ["ip", "netns", "exec", name, *argv]


def available() -> tuple[bool, str]:
    """Whether namespaces, veth pairs and bridges can be created here, tried for real.

    Returns ``(True, "ok")`` or ``(False, reason)``; leaves nothing behind either way.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run as root or fall back to loopback)"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    probe = f"{NS_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _ip("-n", probe, "link", "set", "v0", "master", "br0")
    except RuntimeError as exc:
        return False, f"cannot create veth pairs or a bridge: {exc}"
    finally:
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", probe)
    return True, "ok"


def cleanup_stale() -> list[str]:
    """Delete namespaces this module created in runs whose process is gone; returns their names.

    A run removes its namespaces on exit, but not if it was killed with SIGKILL; this also kills
    the processes such a run left inside them.
    """
    removed = []
    for name in list_netns():
        match = _NS_NAME.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(RuntimeError):
            for pid in _ip("netns", "pids", name).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name)
            removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Namespaces:
    """A context manager that builds an emulated LAN of ``n_targets + 1`` namespaces.

    Topology: a bridge ``br0`` in its own namespace; every host namespace has ``lo`` and an
    ``eth0`` (veth, peer enslaved to the bridge). The hub is ``<prefix>.1``, target i is
    ``<prefix>.<i + 2>``. On exit (exceptions and Ctrl-C included) every process started with
    :meth:`run_in` is stopped and every namespace deleted, which removes its links too. Nothing
    is created in the root namespace. Convert SIGTERM into an exception (e.g. ``SystemExit``) in
    the harness if it should clean up on SIGTERM as well.
    """

    def __init__(self, n_targets: int, prefix: str = LAN_PREFIX) -> None:
        if not 1 <= n_targets <= 250:
            raise ValueError("n_targets must be between 1 and 250")
        base = f"{NS_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_netns = f"{base}-br"
        self.hub = Host("hub", f"{base}-hub", f"{prefix}.1")
        self.targets = [
            Host(f"target{i}", f"{base}-t{i}", f"{prefix}.{i + 2}") for i in range(n_targets)
        ]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []

    @property
    def hosts(self) -> list[Host]:
        """The hub, then the targets."""
        return [self.hub, *self.targets]

    @property
    def names(self) -> list[str]:
        """Every namespace name this LAN uses (bridge included)."""
        return [self.bridge_netns, *(h.netns for h in self.hosts)]

    def __enter__(self) -> Namespaces:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def run_in(
        self, ns: Host | str, argv: Sequence[str], **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside namespace ``ns``; it is stopped when the context exits."""
        name = ns.netns if isinstance(ns, Host) else ns
        if name not in self._created:
            raise ValueError(f"{name} is not a namespace of this LAN")
        proc = subprocess.Popen(netns_exec_argv(name, argv), **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, ns: Host | str, argv: Sequence[str], timeout_s: float = 10.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``ns`` to completion; returns its captured output."""
        name = ns.netns if isinstance(ns, Host) else ns
        return subprocess.run(
            netns_exec_argv(name, argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def close(self) -> None:
        """Stop started processes and delete every namespace created (idempotent)."""
        for proc in self._procs:
            _stop_process(proc)
        self._procs.clear()
        errors = []
        for name in reversed(self._created):
            try:
                _ip("netns", "del", name)
            except RuntimeError as exc:
                errors.append(str(exc))
        self._created.clear()
        if errors:
            log.warning("netem: namespace cleanup problems: %s", "; ".join(errors))

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _create(self) -> None:
        br = self.bridge_netns
        self._add_netns(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge", "stp_state", "0")
        _ip("-n", br, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            self._add_netns(host.netns)
            port = f"p{index}"
            _ip(
                "-n",
                br,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.netns,
            )
            _ip("-n", br, "link", "set", port, "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
        log.info(
            "netem: LAN up: hub %s, targets %s (namespaces %s*)",
            self.hub.ip,
            ", ".join(t.ip for t in self.targets),
            br[: -len("br")],
        )


def _stop_process(proc: subprocess.Popen[Any], grace_s: float = 2.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)
