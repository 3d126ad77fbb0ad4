"""A target's connection to the draft hub: one DEALER socket shared by all of its sequences.

The receive loop decodes every message at the boundary and routes it to the waiting sequence by
its ``ref`` (OPENED, errors before a tag exists) or its session tag (PROPOSAL, later errors).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import numpy as np
import zmq.asyncio

from starsd import protocol, transport
from starsd.protocol import (
    Close,
    Draft,
    Error,
    Hello,
    Open,
    Opened,
    Ping,
    Pong,
    Proposal,
    SamplingParams,
    Stats,
    StatsRequest,
    Welcome,
)

log = logging.getLogger("edge.client")


class HubError(RuntimeError):
    """The hub answered with ERROR (or could not be understood)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"hub error {code}: {message}")
        self.code = code


@dataclass(frozen=True)
class TargetInfo:
    """What the target tells the hub in HELLO."""

    model: str
    vocab_size: int
    tokenizer: str


class HubClient:
    """Session-level API over the DEALER socket: ``open``, ``draft``, ``close``."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, info: TargetInfo) -> None:
        self.sock = transport.dealer(ctx, endpoint)
        self.info = info
        self.welcome: Welcome | None = None
        self._refs = itertools.count(1)
        self._waiting: dict[int | bytes, asyncio.Queue[protocol.Message]] = {}
        self._hello: asyncio.Future[protocol.Message] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Future[None]] = set()
        self._stats: dict[int, asyncio.Future[Stats]] = {}

    async def connect(self, timeout: float = 10.0) -> Welcome:
        """HELLO/WELCOME handshake; raises HubError if the hub refuses this target."""
        self._hello = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_loop())
        await transport.send(self.sock, Hello(self.info.model, self.info.vocab_size,
                                              self.info.tokenizer))  # fmt: skip
        try:
            reply = await asyncio.wait_for(self._hello, timeout)
        except asyncio.TimeoutError:
            raise HubError("TIMEOUT", f"no WELCOME from the hub within {timeout:.0f} s") from None
        if isinstance(reply, Error):
            raise HubError(reply.code, reply.message)
        assert isinstance(reply, Welcome)
        self._check_welcome(reply)
        self.welcome = reply
        log.info("connected to hub %s (draft %s, gamma %d)", reply.epoch.hex()[:8], reply.model,
                 reply.default_gamma)  # fmt: skip
        return reply

    def _check_welcome(self, welcome: Welcome) -> None:
        # The hub checks too; checking here as well means a lax or old hub cannot slip through.
        hello = Hello(self.info.model, self.info.vocab_size, self.info.tokenizer)
        problems = protocol.compatibility_problems(welcome, hello)
        if problems:
            raise HubError(protocol.ErrorCode.INCOMPATIBLE, problems)

    async def open(
        self, prompt: list[int], params: SamplingParams, gamma: int
    ) -> tuple[bytes, asyncio.Queue[protocol.Message]]:
        """Open a session; returns its tag and the queue its proposals arrive on."""
        ref = next(self._refs)
        inbox: asyncio.Queue[protocol.Message] = asyncio.Queue()
        self._waiting[ref] = inbox
        msg = Open(ref, np.asarray(prompt, dtype=np.int32), params, gamma)
        await transport.send(self.sock, msg)
        try:
            reply = await inbox.get()
        finally:
            del self._waiting[ref]
        if isinstance(reply, Error):
            raise HubError(reply.code, reply.message)
        assert isinstance(reply, Opened)
        return reply.tag, inbox

    async def draft(self, tag: bytes, seq: int, accepted: int, appended: list[int]) -> None:
        """Send the verdict on proposal ``seq - 1`` and ask for proposal ``seq``."""
        await transport.send(self.sock, Draft(tag, seq, accepted,
                                              np.asarray(appended, dtype=np.int32)))  # fmt: skip

    async def stats(self, timeout: float = 10.0) -> Stats:
        """The hub's counters (STATS_REQUEST -> STATS)."""
        nonce = next(self._refs)
        reply: asyncio.Future[Stats] = asyncio.get_running_loop().create_future()
        self._stats[nonce] = reply
        try:
            await transport.send(self.sock, StatsRequest(nonce))
            return await asyncio.wait_for(reply, timeout)
        finally:
            del self._stats[nonce]

    async def close_session(self, tag: bytes) -> None:
        """Tell the hub the sequence is finished; stop routing messages for it."""
        self._waiting.pop(tag, None)
        await transport.send(self.sock, Close(tag))

    async def aclose(self) -> None:
        """Stop the reader and close the socket."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.sock.close(linger=0)

    async def _read_loop(self) -> None:
        while True:
            try:
                msg = await transport.recv(self.sock)
            except protocol.ProtocolError as exc:
                log.warning("undecodable message from hub: %s", exc)
                continue
            self._route(msg)

    def _route(self, msg: protocol.Message) -> None:
        match msg:
            case Welcome() if self._hello and not self._hello.done():
                self._hello.set_result(msg)
            case Opened(ref=ref, tag=tag):
                # Register the tag before anything else is read: PROPOSAL seq 0 may be next.
                if ref in self._waiting:
                    self._waiting[tag] = self._waiting[ref]
                self._deliver(ref, msg)
            case Proposal(tag=tag):
                self._deliver(tag, msg)
            case Error(tag=bytes() as tag):
                self._deliver(tag, msg)
            case Error(ref=int() as ref):
                self._deliver(ref, msg)
            case Error() if self._hello and not self._hello.done():
                self._hello.set_result(msg)
            case Stats(nonce=nonce) if nonce in self._stats:
                self._stats[nonce].set_result(msg)
            case Ping(nonce=nonce):
                self._pending.add(asyncio.ensure_future(transport.send(self.sock, Pong(nonce))))
                self._pending = {t for t in self._pending if not t.done()}
            case _:
                log.warning("unexpected %s from hub: %s", type(msg).__name__, msg)

    def _deliver(self, key: int | bytes, msg: protocol.Message) -> None:
        inbox = self._waiting.get(key)
        if inbox is None:
            log.debug("dropped %s for a finished sequence", type(msg).__name__)
            return
        inbox.put_nowait(msg)
