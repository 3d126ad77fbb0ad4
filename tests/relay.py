"""A small TCP relay for fault tests: fixed delay per chunk, and link drops on demand.

Deliberately simple (one task per direction, read -> sleep -> write): a test proxy must be
easier to trust than the system under test. Runs on its own event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class Relay:
    """Forwards 127.0.0.1:<port> to an upstream port; ``cut()`` drops every open connection."""

    def __init__(self, upstream_port: int, delay_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.port = 0
        self.cuts = 0
        self._loop = asyncio.new_event_loop()
        self._conns: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Relay:
        self._thread.start()
        self.port = self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def cut(self) -> int:
        """Close every open connection now (data in flight is lost); returns how many."""
        n = self._call(self._cut())
        self.cuts += n
        return n

    def retarget(self, upstream_port: int) -> int:
        """Send new connections to another port (a service restarted behind the same address)
        and drop the open ones; returns how many were dropped."""
        self.upstream_port = upstream_port
        return self.cut()

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _cut(self) -> int:
        conns = list(self._conns)
        for task in conns:
            task.cancel()
        await asyncio.gather(*conns, return_exceptions=True)
        return len(conns)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._serve(reader, writer))
        self._conns.add(task)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([task])
        self._conns.discard(task)

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            c_writer.close()
            return
        pipes = [asyncio.ensure_future(self._pipe(c_reader, u_writer)),
                 asyncio.ensure_future(self._pipe(u_reader, c_writer))]  # fmt: skip
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for w in (c_writer, u_writer):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            writer.write(data)
            await writer.drain()
