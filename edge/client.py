"""A target's connection to the draft hub: one DEALER socket shared by all of its sequences.

The receive loop decodes every message at the boundary and routes it to the waiting sequence by
its ``ref`` (OPENED, errors before a tag exists) or its session tag (PROPOSAL, later errors).

Liveness: the client PINGs every heartbeat interval the hub announced in WELCOME (that keeps its
lease), and it considers the hub down when it has heard nothing for LIVENESS_INTERVALS intervals,
when a reply carries another epoch (the hub restarted), or on NOT_WELCOMED / SHUTTING_DOWN.
While the hub is down, a background task re-sends HELLO every interval; each accepted WELCOME
starts a new ``generation``, and sessions of older generations are gone. Sequences never wait
for any of this: they read ``up`` and ``generation`` and decode on their own meanwhile
(edge.speculate).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import zmq.asyncio

from starsd import curve_client, protocol, transport
from starsd.protocol import (
    Close,
    Draft,
    Error,
    ErrorCode,
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

# Errors that mean "this connection is not (or no longer) known to the hub".
_HUB_LOST = frozenset({ErrorCode.NOT_WELCOMED, ErrorCode.SHUTTING_DOWN,
                       ErrorCode.UNAUTHENTICATED})  # fmt: skip


class HubError(RuntimeError):
    """The hub answered with ERROR (or could not be understood)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"hub error {code}: {message}")
        self.code = code


class HubUnavailable(HubError):
    """No usable answer from the hub in time; the caller decodes without it."""

    def __init__(self, message: str) -> None:
        super().__init__("UNAVAILABLE", message)


MIN_SESSION_COST = 0.01  # busy fraction one session is assumed to cost an idle hub


@dataclass(frozen=True)
class HubLoad:
    """A hub's load as it reported it (WELCOME, PONG), checked: a hub cannot skew placement
    with negative counts or a busy fraction outside [0, 1]."""

    sessions: int = 0
    queue: int = 0
    busy: float = 0.0

    @classmethod
    def of(cls, msg: protocol.Welcome | protocol.Pong) -> HubLoad:
        busy = msg.busy if math.isfinite(msg.busy) else 1.0
        return cls(max(0, msg.sessions), max(0, msg.queue), min(1.0, max(0.0, busy)))

    def spare(self, placed: int) -> float:
        """Sessions the hub could still take before its drafting thread is busy all the time,
        less its queued jobs and ``placed`` sessions not yet in this report (may be < 0)."""
        # A hub without sessions has nothing to draft: a busy reading then is what its closed
        # sessions left in the window, not load (else a hub freed a moment ago looks full).
        busy = self.busy if self.sessions else 0.0
        cost = max(busy / self.sessions if self.sessions else 0.0, MIN_SESSION_COST)
        return (1.0 - busy) / cost - self.queue - placed


@dataclass(frozen=True)
class TargetInfo:
    """What the target tells the hub in HELLO."""

    model: str
    vocab_size: int
    tokenizer: str
    feature_width: int = 0  # > 0: this target can send its features (for EAGLE hubs)
    push: int = 0  # pushed branches per round its sessions take (Open.push; 0: none)


def push_for(params: SamplingParams, push: int, offered: int) -> int:
    """The pushed branches a session asks for: ``push``, at most what the hub ``offered`` in
    WELCOME (0 from a hub that predates pushes: it would refuse an OPEN with the field), and
    none for plain sampling, whose every branch would carry q dense (gamma x V float32: 128 KB
    per 4 branches of 4 tokens at V = 2048, 2 MB at V = 32000) and cost a slow link more than
    the round trip it saves; greedy branches carry no q and top-k / top-p ones only their
    support."""
    return min(push, offered) if params.greedy or params.truncated else 0


class HubClient:
    """Session-level API over the DEALER socket: ``open``, ``draft``, ``close_session``."""

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, info: TargetInfo,
        curve: curve_client.CurveClientConfig | None = None,
    ) -> None:  # fmt: skip
        self.sock, self._watch = transport.dealer(ctx, endpoint, curve)
        self.endpoint = endpoint
        self.info = info
        self.welcome: Welcome | None = None  # None while the hub is down or not yet reached
        self.announced: Welcome | None = None  # the last WELCOME, kept while the hub is down
        self.generation = 0
        self.last_heard = time.monotonic()
        self.down_since = 0.0  # when mark_down last found it down (time.monotonic)
        self.heartbeat_s = 1.0
        self._refs = itertools.count(1)
        self._waiting: dict[int | bytes, asyncio.Queue[protocol.Message]] = {}
        self._hello: asyncio.Future[protocol.Message] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Future[None]] = set()
        self._stats: dict[int, asyncio.Future[Stats]] = {}
        # Placement (edge.hubs): the hub's last load report, sessions placed here by this
        # target in all, and how many of them that report (or the PING it answered) saw.
        self.load = HubLoad()
        self.placed = 0
        self._placed_reported = 0
        self._placed_at_ping = 0
        self._full_until = 0.0  # RESOURCE_EXHAUSTED: place no session here until then

    @property
    def placed_since_report(self) -> int:
        """Sessions placed on this hub that its last load report does not count yet."""
        return self.placed - self._placed_reported

    def _reported(self, load: HubLoad, placed_seen: int) -> None:
        self.load = load
        self._placed_reported = placed_seen

    def mark_full(self) -> None:
        """The hub refused a session for lack of room: place none here for two heartbeats."""
        self._full_until = time.monotonic() + 2 * self.heartbeat_s

    def full(self) -> bool:
        """Whether the hub recently refused a session for lack of room."""
        return time.monotonic() < self._full_until

    @property
    def up(self) -> bool:
        """Whether the hub is currently believed to be serving this target."""
        return self.welcome is not None

    async def connect(self, timeout: float = 10.0) -> Welcome:
        """First HELLO/WELCOME; raises HubError if refused, HubUnavailable if no answer.

        With CURVE a rejected key raises curve_client.HandshakeRejected within a second. Either
        way the liveness tasks keep running, so a hub that comes up later is picked up.
        """
        if self._watch is not None:
            await self._watch.wait(timeout_s=min(timeout, 1.0))
        self._tasks = [asyncio.create_task(self._read_loop()),
                       asyncio.create_task(self._liveness_loop())]  # fmt: skip
        return await self._handshake(timeout)

    async def _handshake(self, timeout: float) -> Welcome:
        # One pending HELLO future for every waiter: the liveness loop re-sends HELLO while
        # connect() still waits, and whichever WELCOME comes back must reach both.
        if self._hello is None or self._hello.done():
            self._hello = asyncio.get_running_loop().create_future()
        hello = self._hello
        await transport.send(self.sock, self._hello_msg())
        try:
            reply = await asyncio.wait_for(asyncio.shield(hello), timeout)
        except asyncio.TimeoutError:
            raise HubUnavailable(f"no WELCOME from the hub within {timeout:.1f} s") from None
        if isinstance(reply, Error):
            raise HubError(reply.code, reply.message)
        assert isinstance(reply, Welcome)
        if reply is not self.welcome:  # the other waiter on this HELLO may have taken it already
            self._check_welcome(reply)
            self._welcomed(reply)
        return reply

    def _welcomed(self, welcome: Welcome) -> None:
        self.welcome = self.announced = welcome
        self.generation += 1
        self.heartbeat_s = welcome.heartbeat_ms / 1000
        self.last_heard = time.monotonic()
        self._reported(HubLoad.of(welcome), self.placed)
        log.info("connected to hub %s at %s (draft %s, gamma %d, generation %d, %d sessions)",
                 welcome.epoch.hex(), self.endpoint, welcome.model, welcome.default_gamma,
                 self.generation, welcome.sessions)  # fmt: skip

    def _check_welcome(self, welcome: Welcome) -> None:
        # The hub checks too; checking here as well means a lax or old hub cannot slip through.
        hello = self._hello_msg()
        problems = protocol.compatibility_problems(welcome, hello)
        if problems:
            raise HubError(ErrorCode.INCOMPATIBLE, problems)

    def _hello_msg(self) -> Hello:
        info = self.info
        return Hello(info.model, info.vocab_size, info.tokenizer,
                     feature_width=info.feature_width)  # fmt: skip

    def mark_down(self, reason: str) -> None:
        """Stop using the hub until a new WELCOME; sessions of this generation are void, and
        each waiting sequence hears so at once (it re-opens elsewhere or decodes alone)."""
        if self.welcome is None:
            return
        log.warning("hub %s unavailable (%s): its sessions move to another hub or decode alone",
                    self.endpoint, reason)  # fmt: skip
        self.welcome = None
        self.down_since = time.monotonic()
        lost = f"hub {self.endpoint} is down: {reason}"
        for key, inbox in self._waiting.items():
            tag, ref = (key, None) if isinstance(key, bytes) else (None, key)
            inbox.put_nowait(Error(ErrorCode.NOT_WELCOMED, lost, ref=ref, tag=tag))

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            silent = time.monotonic() - self.last_heard
            if self.up and silent > protocol.LIVENESS_INTERVALS * self.heartbeat_s:
                self.mark_down(f"nothing heard for {silent:.1f} s")
            if self.up:
                self._placed_at_ping = self.placed
                await transport.send(self.sock, Ping(next(self._refs)))
            else:
                await self._try_rejoin()

    async def _try_rejoin(self) -> None:
        try:
            await self._handshake(self.heartbeat_s)
        except HubUnavailable:
            pass
        except HubError as exc:
            log.error("hub refused this target: %s", exc)

    @property
    def wants_features(self) -> bool:
        """Whether the hub drafts from target features (EAGLE): OPEN and DRAFT must carry them."""
        return self.welcome is not None and self.welcome.feature_width > 0

    async def open(
        self, prompt: list[int], params: SamplingParams, gamma: int, timeout: float = 10.0,
        features: np.ndarray | None = None,
    ) -> tuple[bytes, asyncio.Queue[protocol.Message]]:  # fmt: skip
        """Open a session; returns its tag and the queue its proposals arrive on.

        Raises HubUnavailable after ``timeout`` (an OPENED arriving later is closed at once).
        """
        ref = next(self._refs)
        inbox: asyncio.Queue[protocol.Message] = asyncio.Queue()
        self._waiting[ref] = inbox
        offered = self.welcome.push if self.welcome is not None else 0
        msg = Open(ref, np.asarray(prompt, dtype=np.int32), params, gamma, features,
                   push=push_for(params, self.info.push, offered))  # fmt: skip
        try:
            await transport.send(self.sock, msg)
            reply = await asyncio.wait_for(inbox.get(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._close_unclaimed(inbox)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise HubUnavailable(f"no OPENED within {timeout:.2f} s") from None
        finally:
            del self._waiting[ref]
        if isinstance(reply, Error):
            raise HubError(reply.code, reply.message)
        assert isinstance(reply, Opened)
        return reply.tag, inbox

    async def draft(
        self, tag: bytes, seq: int, accepted: int, appended: list[int],
        features: np.ndarray | None = None, taken: int = 0,
    ) -> None:  # fmt: skip
        """Send the verdict on proposal ``seq - 1`` and ask for proposal ``seq`` (or, with
        ``taken``, say that the pushed branch of that many tokens is proposal ``seq``)."""
        ids = np.asarray(appended, dtype=np.int32)
        await transport.send(self.sock, Draft(tag, seq, accepted, ids, features, taken))

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
        """Stop the background tasks and close the socket."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._watch is not None:
            self._watch.close()
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
        if isinstance(msg, Welcome):
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)
            return
        if self._stale(msg):
            return
        self.last_heard = time.monotonic()
        self._dispatch(msg)

    def _stale(self, msg: protocol.Message) -> bool:
        """A reply from another hub process than the one we were welcomed by."""
        epoch = getattr(msg, "epoch", b"")
        if not epoch or self.welcome is None or epoch == self.welcome.epoch:
            return False
        self.mark_down("the hub restarted (new epoch)")
        return True

    def _dispatch(self, msg: protocol.Message) -> None:
        match msg:
            case Opened(ref=ref, tag=tag):
                self._opened(ref, tag, msg)
            case Proposal(tag=tag):
                self._deliver(tag, msg)
            case Error(code=code, tag=None, ref=None) if code in _HUB_LOST:
                self._hub_lost(msg)
            case Error(tag=bytes() as tag):
                self._deliver(tag, msg)
            case Error(ref=int() as ref):
                self._deliver(ref, msg)
            case Error() if self._hello and not self._hello.done():
                self._hello.set_result(msg)
            case Stats(nonce=nonce) if nonce in self._stats:
                self._stats[nonce].set_result(msg)
            case Ping(nonce=nonce):
                self._send_soon(Pong(nonce))
            case Pong():
                self._reported(HubLoad.of(msg), self._placed_at_ping)
            case _:
                log.warning("unexpected %s from hub: %s", type(msg).__name__, msg)

    def _opened(self, ref: int, tag: bytes, msg: Opened) -> None:
        # Register the tag before anything else is read: PROPOSAL seq 0 may be next.
        if ref not in self._waiting:  # its OPEN timed out: nobody wants this session
            self._send_soon(Close(tag))
            return
        self._waiting[tag] = self._waiting[ref]
        self._deliver(ref, msg)

    def _close_unclaimed(self, inbox: asyncio.Queue[protocol.Message]) -> None:
        """Close a session whose OPENED reached the inbox but not the caller (it timed out or
        was cancelled at that moment, e.g. an HTTP client went away): else it would stay open
        on the hub until this target's lease ends."""
        while not inbox.empty():
            msg = inbox.get_nowait()
            if isinstance(msg, Opened):
                self._waiting.pop(msg.tag, None)
                self._send_soon(Close(msg.tag))

    def _hub_lost(self, msg: Error) -> None:
        if self._hello is not None and not self._hello.done():
            self._hello.set_result(msg)
        self.mark_down(f"{msg.code}: {msg.message}")

    def _send_soon(self, msg: protocol.Message) -> None:
        self._pending.add(asyncio.ensure_future(transport.send(self.sock, msg)))
        self._pending = {t for t in self._pending if not t.done()}

    def _deliver(self, key: int | bytes, msg: protocol.Message) -> None:
        inbox = self._waiting.get(key)
        if inbox is None:
            log.debug("dropped %s for a finished sequence", type(msg).__name__)
            return
        inbox.put_nowait(msg)
