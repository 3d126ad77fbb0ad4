"""The user-space link of the LAN benchmark: a TCP proxy adding one-way delay and a rate cap.

This kernel has no ``netem`` qdisc, so delay and bandwidth are emulated in user space:
:class:`DelayProxy` is a TCP forwarding proxy that delivers every chunk ``delay_ms`` after it
arrived (per direction, order preserved, pipelined rather than serial) and caps the bandwidth of
each direction with a token bucket shared by the proxy's connections. It forwards any byte
stream, ZeroMQ's ZMTP included.

Links can also be dropped on demand (:meth:`DelayProxy.cut`) and new connections sent to another
upstream port (:meth:`DelayProxy.retarget`), as for a service restarted behind one address.

Used by scripts/emulate/netem.py (its ``proxy`` command and self-check), scripts/bench/run.py
(the loopback fallback of the LAN suite), tests/test_netem.py and tests/test_faults.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("netem")


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
    cuts: int = 0


@dataclass
class _Counters:
    connections: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    cuts: int = 0


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
        self._upstream_port = config.upstream_port
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
        return ProxyStats(
            c.connections, c.bytes_up, c.bytes_down, active=len(self._tasks), cuts=c.cuts
        )

    @property
    def cuts(self) -> int:
        """Connections dropped by :meth:`cut` (or :meth:`retarget`) so far."""
        return self._counters.cuts

    async def drop_connections(self) -> int:
        """Close every open connection now (data in flight is lost); returns how many."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._counters.cuts += len(tasks)
        return len(tasks)

    def cut(self, timeout_s: float = 10.0) -> int:
        """:meth:`drop_connections` on a proxy started with :meth:`start_background`."""
        if self._loop is None:
            raise RuntimeError("proxy not running in the background")
        future = asyncio.run_coroutine_threadsafe(self.drop_connections(), self._loop)
        return future.result(timeout_s)

    def retarget(self, upstream_port: int) -> int:
        """Send new connections to ``upstream_port`` and drop the open ones (background proxy);
        returns how many were dropped."""
        self._upstream_port = upstream_port
        return self.cut()

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
            host,
            port,
            cfg.upstream_host,
            self._upstream_port,
            cfg.delay_ms,
            f"{cfg.rate_mbit:g} Mbit/s" if cfg.rate_mbit else "unlimited",
        )
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
            stats.connections,
            stats.bytes_up,
            stats.bytes_down,
        )
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
                    cfg.upstream_host, self._upstream_port, limit=cfg.chunk_bytes
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
