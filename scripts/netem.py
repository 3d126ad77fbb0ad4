"""Network-emulation building blocks for the LAN benchmark: a delaying TCP proxy and namespaces.

This kernel has no ``netem`` qdisc, so delay and bandwidth are emulated in user space:

* :class:`DelayProxy` is a TCP forwarding proxy that delivers every chunk ``delay_ms`` after it
  arrived (per direction, order preserved, pipelined rather than serial) and caps the bandwidth
  of each direction with a token bucket shared by the proxy's connections. It forwards any byte
  stream, ZeroMQ's ZMTP included.
* :class:`Namespaces` builds an emulated LAN: one "hub" and N "target" network namespaces, each
  with an ``eth0`` plugged into a Linux bridge that lives in its own namespace, addressed from
  10.77.0.0/24. Nothing is created in the root namespace and everything is removed on exit.

Standalone use::

    python scripts/netem.py proxy --listen 127.0.0.1:6000 --upstream 127.0.0.1:5555 \\
        --delay-ms 5 --rate-mbit 100
    python scripts/netem.py check      # self-check: proxy delay and rate, namespaces
    python scripts/netem.py cleanup    # remove namespaces left behind by dead runs

The proxy logs ``netem proxy listening on HOST:PORT -> HOST:PORT`` (stderr) once it accepts
connections, which a harness can wait for; SIGINT or SIGTERM stop it and log a byte summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger("netem")

LAN_PREFIX = "10.77.0"
"""The first three octets of the emulated LAN (a /24); hosts get .1 (hub), .2, .3, ..."""
NS_PREFIX = "starsd"
"""Every namespace this module creates is named ``starsd-<pid>-<token>-<role>``."""
_NS_NAME = re.compile(rf"^{NS_PREFIX}-(\d+)-[0-9a-f]+-")
_IP_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------------------------
# Delay / bandwidth proxy
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProxyConfig:
    """What a :class:`DelayProxy` listens on, forwards to, and how it shapes traffic.

    ``delay_ms`` is one-way (each direction), so a request/response round trip gains
    ``2 * delay_ms``. ``rate_mbit`` caps each direction (0 = unlimited) with a token bucket that
    all connections of one proxy share, so one proxy behaves like one link; each chunk is due at
    ``arrival + serialisation + delay``. ``burst_bytes`` (default 0) may pass ahead of the rate.
    Timers alone are up to 1 ms late, so each delivery busy-waits (yielding to the event loop)
    for its last ``spin_ms``; 0 saves that CPU at the cost of ~+1 ms per direction.
    ``max_buffer_bytes`` bounds the data held per direction per connection; keep it above the
    bandwidth-delay product (rate * delay) or it, not the rate, limits throughput.
    """

    upstream_host: str
    upstream_port: int
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    delay_ms: float = 0.0
    rate_mbit: float = 0.0
    chunk_bytes: int = 64 * 1024
    max_buffer_bytes: int = 8 * 1024 * 1024
    burst_bytes: int = 0
    spin_ms: float = 1.0
    connect_timeout_s: float = 5.0
    close_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if min(self.delay_ms, self.rate_mbit, self.burst_bytes, self.spin_ms) < 0:
            raise ValueError("delay_ms, rate_mbit, burst_bytes and spin_ms must be >= 0")
        if self.chunk_bytes <= 0 or self.max_buffer_bytes < self.chunk_bytes:
            raise ValueError("need chunk_bytes > 0 and max_buffer_bytes >= chunk_bytes")


@dataclass(frozen=True)
class ProxyStats:
    """Totals so far: ``up`` is client -> upstream, ``down`` is upstream -> client.

    ``connections`` counts every accepted connection, ``active`` those still open.
    """

    connections: int
    bytes_up: int
    bytes_down: int
    active: int = 0


@dataclass
class _Counters:
    connections: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class TokenBucket:
    """A token bucket in its virtual-scheduling form: it stamps data instead of sleeping.

    :meth:`schedule` returns when ``n`` bytes arriving at ``now`` have finished serialising on a
    link of ``rate_bytes_s`` (after everything scheduled before them), allowing a burst of
    ``burst_bytes`` ahead of the nominal rate. Because deadlines come from arrival times, not
    from when the event loop gets round to writing, a late wake-up is caught up on afterwards
    and the long-run rate stays exact. With ``burst_bytes = 0`` every message pays its full
    serialisation delay, as on a real link. Share one per direction between the tasks of a loop.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: int = 0) -> None:
        if rate_bytes_s <= 0:
            raise ValueError("rate_bytes_s must be > 0")
        self.rate = rate_bytes_s
        self.tolerance_s = burst_bytes / rate_bytes_s
        self._free_at = 0.0

    def schedule(self, n: int, now: float) -> float:
        """Reserve the link for ``n`` bytes arriving at ``now``; returns when they are through."""
        start = max(now - self.tolerance_s, self._free_at)
        self._free_at = start + n / self.rate
        return max(self._free_at, now)


@dataclass(frozen=True)
class _Item:
    deliver_at: float
    data: bytes | None  # None: end of stream
    reset: bool = False


@dataclass
class _Direction:
    """Shaping state for one direction of a proxy (shared by its connections)."""

    name: str
    bucket: TokenBucket | None
    add_bytes: Callable[[int], None]
    piece_bytes: int

    def deadline(self, n: int, now: float, delay_s: float) -> float:
        """When ``n`` bytes read at ``now`` are due at the far end: serialisation + delay."""
        done = now if self.bucket is None else self.bucket.schedule(n, now)
        return done + delay_s


class DelayProxy:
    """A user-space TCP proxy adding one-way delay and a bandwidth cap to each direction.

    Use it in a running event loop (``await start()`` / ``await stop()`` or ``async with``), or
    from synchronous code on a background thread (``with DelayProxy(cfg) as p:`` or
    :meth:`start_background` / :meth:`stop_background`).
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._counters = _Counters()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._address: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up: _Direction | None = None
        self._down: _Direction | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the proxy listens on; valid once started."""
        if self._address is None:
            raise RuntimeError("proxy not started")
        return self._address

    @property
    def stats(self) -> ProxyStats:
        """Connections accepted and open, bytes forwarded so far."""
        c = self._counters
        return ProxyStats(c.connections, c.bytes_up, c.bytes_down, active=len(self._tasks))

    async def start(self) -> tuple[str, int]:
        """Bind and start accepting; returns the listening (host, port)."""
        cfg = self.config
        self._up = self._direction("up", self._add_up)
        self._down = self._direction("down", self._add_down)
        self._server = await asyncio.start_server(
            self._on_client, cfg.listen_host, cfg.listen_port, limit=cfg.chunk_bytes
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self._address = (host, port)
        log.info(
            "netem proxy listening on %s:%d -> %s:%d (delay %.1f ms, rate %s)",
            host, port, cfg.upstream_host, cfg.upstream_port, cfg.delay_ms,
            f"{cfg.rate_mbit:g} Mbit/s" if cfg.rate_mbit else "unlimited",
        )  # fmt: skip
        return self._address

    async def stop(self) -> ProxyStats:
        """Stop accepting, close every connection, log and return the totals."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        stats = self.stats
        log.info(
            "netem proxy stopped: %d connections, %d bytes up, %d bytes down",
            stats.connections, stats.bytes_up, stats.bytes_down,
        )  # fmt: skip
        return stats

    async def __aenter__(self) -> DelayProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start_background(self, timeout_s: float = 5.0) -> tuple[str, int]:
        """Run the proxy on its own event loop in a daemon thread; returns (host, port)."""
        if self._thread is not None:
            raise RuntimeError("proxy already running in the background")
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except (OSError, ValueError) as exc:
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=main, name="netem-proxy", daemon=True)
        self._thread.start()
        if not started.wait(timeout_s):
            raise TimeoutError("proxy did not start in time")
        if failure:
            self._thread.join(timeout_s)
            self._thread = None
            raise failure[0]
        return self.address

    def stop_background(self, timeout_s: float = 5.0) -> ProxyStats:
        """Stop a proxy started with :meth:`start_background` and join its thread."""
        if self._thread is None or self._loop is None:
            return self.stats
        future = asyncio.run_coroutine_threadsafe(self.stop(), self._loop)
        try:
            stats = future.result(timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            self._thread = None
        return stats

    def __enter__(self) -> DelayProxy:
        self.start_background()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_background()

    # -- internals --------------------------------------------------------------------------

    def _add_up(self, n: int) -> None:
        self._counters.bytes_up += n

    def _add_down(self, n: int) -> None:
        self._counters.bytes_down += n

    def _direction(self, name: str, add_bytes: Callable[[int], None]) -> _Direction:
        cfg = self.config
        if cfg.rate_mbit <= 0:
            return _Direction(name, None, add_bytes, cfg.chunk_bytes)
        rate = cfg.rate_mbit * 1e6 / 8
        # Forward in pieces of about 1 ms of link time so the output is smooth, not bursty.
        piece = max(1500, min(cfg.chunk_bytes, int(rate / 1000)))
        return _Direction(name, TokenBucket(rate, cfg.burst_bytes), add_bytes, piece)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Serve in an inner task: stop() cancels that one, never asyncio's own handler task
        # (cancelling the handler makes Python 3.11's start_server log a spurious traceback).
        inner = asyncio.ensure_future(self._serve(reader, writer))
        self._tasks.add(inner)
        try:
            await asyncio.wait([inner])
        finally:
            self._tasks.discard(inner)
        if not inner.cancelled() and inner.exception() is not None:
            log.warning("netem proxy connection failed: %r", inner.exception())

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        self._counters.connections += 1
        number = self._counters.connections
        peer = c_writer.get_extra_info("peername")
        log.info("netem proxy connection #%d from %s", number, peer)
        try:
            u_reader, u_writer = await asyncio.wait_for(
                asyncio.open_connection(
                    cfg.upstream_host, cfg.upstream_port, limit=cfg.chunk_bytes
                ),
                cfg.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("netem proxy connection #%d: upstream unreachable: %s", number, exc)
            await _close(c_writer)
            return
        assert self._up is not None and self._down is not None
        try:
            await self._run_pipes(
                self._pipe(c_reader, u_writer, self._up), self._pipe(u_reader, c_writer, self._down)
            )
        finally:
            await asyncio.gather(_close(c_writer), _close(u_writer))
            log.debug("netem proxy connection #%d closed", number)

    async def _run_pipes(self, *pipes: Any) -> None:
        """Run both directions; on a reset close at once, on a clean EOF allow a grace period."""
        tasks = [asyncio.ensure_future(p) for p in pipes]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            failed = any(t.exception() is not None for t in done)
            if pending and not failed:
                done, pending = await asyncio.wait(pending, timeout=self.config.close_grace_s)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: _Direction
    ) -> None:
        """Forward one direction: a reader stamps pieces, a writer delivers them when due."""
        queue: asyncio.Queue[_Item] = asyncio.Queue(
            maxsize=max(1, self.config.max_buffer_bytes // direction.piece_bytes)
        )
        pump = asyncio.ensure_future(self._read_into(reader, queue, direction))
        try:
            await self._deliver(queue, writer, direction)
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    async def _read_into(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[_Item], direction: _Direction
    ) -> None:
        delay = self.config.delay_ms / 1000.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await reader.read(self.config.chunk_bytes)
            except OSError:
                await queue.put(_Item(loop.time() + delay, None, reset=True))
                return
            if not data:
                await queue.put(_Item(loop.time() + delay, None))
                return
            now = loop.time()
            for start in range(0, len(data), direction.piece_bytes):
                piece = data[start : start + direction.piece_bytes]
                await queue.put(_Item(direction.deadline(len(piece), now, delay), piece))

    async def _wait_until(self, when: float, loop: asyncio.AbstractEventLoop) -> None:
        """Sleep until ``when`` (loop time), precisely.

        asyncio timers fire up to 1 ms late (epoll rounds timeouts up to whole milliseconds),
        so the last ``spin_ms`` are spent yielding to the loop instead, which keeps serving
        other connections but costs CPU.
        """
        remaining = when - loop.time()
        spin = self.config.spin_ms / 1000.0
        if remaining > spin:
            await asyncio.sleep(remaining - spin)
        while loop.time() < when:
            await asyncio.sleep(0)

    async def _deliver(
        self, queue: asyncio.Queue[_Item], writer: asyncio.StreamWriter, direction: _Direction
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await queue.get()
            await self._wait_until(item.deliver_at, loop)
            if item.data is None:
                if item.reset:
                    raise ConnectionResetError(f"{direction.name}: peer reset the connection")
                if writer.can_write_eof():
                    writer.write_eof()
                return
            direction.add_bytes(len(item.data))  # counted first: a receiver never sees it early
            writer.write(item.data)
            await writer.drain()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 1.0)


def proxy_argv(config: ProxyConfig, python: str = sys.executable) -> list[str]:
    """The command line that runs ``config`` as a subprocess (e.g. inside a namespace)."""
    return [
        python, str(Path(__file__).resolve()), "proxy",
        "--listen", f"{config.listen_host}:{config.listen_port}",
        "--upstream", f"{config.upstream_host}:{config.upstream_port}",
        "--delay-ms", f"{config.delay_ms:g}",
        "--rate-mbit", f"{config.rate_mbit:g}",
        "--max-buffer-kib", str(config.max_buffer_bytes // 1024),
        "--burst-bytes", str(config.burst_bytes),
        "--spin-ms", f"{config.spin_ms:g}",
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Network namespaces
# --------------------------------------------------------------------------------------------


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
            netns_exec_argv(name, argv), capture_output=True, text=True, timeout=timeout_s,
            check=False,
        )  # fmt: skip

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
            _ip("-n", br, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", host.netns)  # fmt: skip
            _ip("-n", br, "link", "set", port, "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
        log.info(
            "netem: LAN up: hub %s, targets %s (namespaces %s*)",
            self.hub.ip, ", ".join(t.ip for t in self.targets), br[: -len("br")],
        )  # fmt: skip


def _stop_process(proc: subprocess.Popen[Any], grace_s: float = 2.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class CliArgs:
    """Parsed command line."""

    command: str
    proxy: ProxyConfig | None
    log_level: str


def parse_args(argv: Sequence[str] | None = None) -> CliArgs:
    """Parse the command line into :class:`CliArgs`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy", help="run a delay/bandwidth proxy until SIGINT/SIGTERM")
    proxy.add_argument("--listen", type=parse_hostport, required=True, metavar="HOST:PORT")
    proxy.add_argument("--upstream", type=parse_hostport, required=True, metavar="HOST:PORT")
    proxy.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    proxy.add_argument("--rate-mbit", type=float, default=0.0, help="per direction, 0 = no cap")
    proxy.add_argument("--max-buffer-kib", type=int, default=8192, help="per direction")
    proxy.add_argument("--burst-bytes", type=int, default=0, help="may pass ahead of the rate")
    proxy.add_argument("--spin-ms", type=float, default=1.0, help="busy-wait before each due time")
    sub.add_parser("check", help="self-check: proxy delay and rate, namespaces")
    sub.add_parser("cleanup", help="delete namespaces left behind by dead runs")
    ns = parser.parse_args(argv)
    config = None
    if ns.command == "proxy":
        config = ProxyConfig(
            listen_host=ns.listen[0], listen_port=ns.listen[1],
            upstream_host=ns.upstream[0], upstream_port=ns.upstream[1],
            delay_ms=ns.delay_ms, rate_mbit=ns.rate_mbit,
            max_buffer_bytes=ns.max_buffer_kib * 1024, burst_bytes=ns.burst_bytes,
            spin_ms=ns.spin_ms,
        )  # fmt: skip
    return CliArgs(ns.command, config, ns.log_level.upper())


async def _serve_until_signal(config: ProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    proxy = DelayProxy(config)
    await proxy.start()
    sys.stderr.flush()
    await stop.wait()
    await proxy.stop()


# -- self-check -------------------------------------------------------------------------------


class _EchoServer:
    """A TCP echo server on a daemon thread (one connection at a time), for checks and tests."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._serve, name="netem-echo", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    while data := conn.recv(65536):
                        conn.sendall(data)

    def close(self) -> None:
        """Stop accepting (shutdown wakes the blocked accept()) and join the thread."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(2.0)


def measure_rtt(host: str, port: int, rounds: int = 5, timeout_s: float = 5.0) -> float:
    """Median seconds for a 1-byte request/response echo through ``host:port``."""
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                raise ConnectionError("echo returned the wrong byte")
            samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def measure_throughput(host: str, port: int, n_bytes: int, timeout_s: float = 10.0) -> float:
    """Seconds to push ``n_bytes`` through an echo at ``host:port`` and read them all back."""
    payload = b"\0" * n_bytes
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        start = time.perf_counter()
        sender = threading.Thread(target=conn.sendall, args=(payload,), daemon=True)
        sender.start()
        received = 0
        while received < n_bytes:
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise ConnectionError("connection closed early")
            received += len(chunk)
        elapsed = time.perf_counter() - start
        sender.join(timeout_s)
    return elapsed


def self_check() -> bool:
    """Measure the proxy on loopback and try the namespaces; print results, return success."""
    server = _EchoServer()
    host, port = server.address
    ok = True
    try:
        base = measure_rtt(host, port)
        with DelayProxy(ProxyConfig(host, port, delay_ms=20)) as proxy:
            rtt = measure_rtt(*proxy.address)
        good = 0.040 <= rtt < 0.060
        ok &= good
        print(f"rtt: direct {base * 1e3:.2f} ms, via 20 ms proxy {rtt * 1e3:.2f} ms  [{good}]")
        with DelayProxy(ProxyConfig(host, port, rate_mbit=40)) as proxy:
            elapsed = measure_throughput(*proxy.address, 2_000_000)
        # The echo crosses the proxy twice, each way capped at 40 Mbit/s, pipelined: ~0.4 s.
        good = 0.3 <= elapsed <= 0.5
        ok &= good
        print(f"rate: 2 MB echoed at 40 Mbit/s in {elapsed:.3f} s (expect 0.40)  [{good}]")
    finally:
        server.close()
    usable, reason = available()
    print(f"namespaces available: {usable} ({reason})")
    if usable:
        with Namespaces(2) as lan:
            done = lan.run(lan.targets[0], [sys.executable, "-c", "import socket"])
            print(f"namespaces: {lan.names} created, python runs inside: {done.returncode == 0}")
        left = set(lan.names) & set(list_netns())
        ok &= not left
        print(f"namespaces removed: {not left}")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``proxy``, ``check`` or ``cleanup``."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    if args.command == "proxy":
        assert args.proxy is not None
        asyncio.run(_serve_until_signal(args.proxy))
        return 0
    if args.command == "cleanup":
        print("removed:", " ".join(cleanup_stale()) or "nothing")
        return 0
    return 0 if self_check() else 1


if __name__ == "__main__":
    sys.exit(main())
