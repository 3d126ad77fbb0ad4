"""A target's connection to the draft hub: one DEALER socket shared by all of its sequences.

The receive loop decodes every message at the boundary and routes it to the waiting sequence by
its ``ref`` or its session tag (:mod:`edge.routes`).

Liveness: the client PINGs every heartbeat interval the hub announced in WELCOME (that keeps its
lease), and it considers the hub down when it has heard nothing for LIVENESS_INTERVALS intervals,
when a reply carries another epoch (the hub restarted), or on NOT_WELCOMED / SHUTTING_DOWN.
While the hub is down, a background task re-sends HELLO every interval; each accepted WELCOME
starts a new ``generation``, and sessions of older generations are gone. Sequences never wait
for any of this: they read ``up`` and ``generation`` and decode on their own meanwhile
(edge.speculate).

A hub is trusted for drafts only, never for the target's liveness or memory. Everything it sends
is read under a budget (:mod:`starsd.budget`): what the target asked for is free (per session,
one proposal and the pushed branches it asked for per request; the PONG to its own PING; the
OPENED of its OPEN), everything else spends a small rate, and past it messages are dropped
before they are decoded; the read loop yields to the event loop every ``YIELD_EVERY`` messages,
so a flooding hub cannot starve the other hubs, the model thread's callbacks or an HTTP server
on the same loop. Every number a WELCOME carries is clamped or refused (:func:`checked_welcome`),
a session's inbox is bounded, a proposal beyond a session's credit is dropped, and a hub that
sends what no honest hub would (a proposal the target refuses, an unexpected error) is set aside
for a while (:meth:`HubClient.strike`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np
import zmq
import zmq.asyncio

from edge.handshake import (
    HubError,
    HubLoad,
    HubUnavailable,
    LoadView,
    TargetInfo,
    checked_welcome,
    push_for,
    tap_problem,
)
from edge.routes import Inbox, SessionRoutes
from starsd import curve_client, limits, protocol, transport
from starsd.budget import PeerBudget, Rates
from starsd.logsafe import Throttle, printable
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
    timing_us,
)

log = logging.getLogger("edge.client")

# Errors that mean "this connection is not (or no longer) known to the hub".
_HUB_LOST = frozenset({ErrorCode.NOT_WELCOMED, ErrorCode.SHUTTING_DOWN, ErrorCode.UNAUTHENTICATED})


YIELD_EVERY = 32  # messages read from one hub before the read loop lets others run
# Unsolicited messages (PINGs, errors, anything not asked for) per second a hub may send: an
# honest hub sends one PONG per PING and a few errors; the rest is dropped undecoded.
HUB_RATES = Rates(base_per_s=50.0, per_session_per_s=20.0, burst_s=2.0)
CLOSE_LINGER_MS = 200  # on close, how long queued CLOSEs may still go out (a live hub frees
# those sessions now, not when this target's lease ends; a dead hub delays closing this long)
STRIKE_BASE_S = 2.0  # a misbehaving hub is set aside this long, doubling per strike...
STRIKE_MAX_S = 60.0  # ...up to this
_BUDGET_KEY = b"hub"  # one bucket per client: a client talks to one hub


class HubClient:
    """Session-level API over the DEALER socket: ``open``, ``draft``, ``close_session``.

    Owned by the event loop: every method and callback runs there, so nothing here is locked.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        info: TargetInfo,
        curve: curve_client.CurveClientConfig | None = None,
    ) -> None:
        frames = limits.target_max_frame_bytes(info.vocab_size)
        self.sock, self._watch = transport.dealer(ctx, endpoint, curve, max_frame_bytes=frames)
        self.endpoint = endpoint
        self.info = info
        self.welcome: Welcome | None = None  # None while the hub is down or not yet reached
        self.announced: Welcome | None = None  # the last WELCOME, kept while the hub is down
        self.generation = 0
        self.last_heard = time.monotonic()
        self.down_since = 0.0  # when mark_down last found it down (time.monotonic)
        self.heartbeat_s = 1.0
        self._refs = itertools.count(1)
        self._routes = SessionRoutes(info.push)  # sequences' inboxes and sessions' credit
        self._hello: asyncio.Future[protocol.Message] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stats: dict[int, asyncio.Future[Stats]] = {}
        self.placement = LoadView()  # what edge.hubs places sessions by
        self._reported = asyncio.Event()  # set by every load report (fresh_load waits on it)
        self._full_until = 0.0  # RESOURCE_EXHAUSTED: place no session here until then
        # Defences against the hub (module docstring): the read budget (each session's credit
        # is in ``_routes``), strikes (the PING we wait a PONG for: placement).
        self._budget = PeerBudget(HUB_RATES)
        self._strikes = 0
        self._set_aside_until = 0.0
        self._throttle = Throttle()
        self.dropped = 0  # messages from this hub dropped (over budget, unsolicited, too many)

    async def fresh_load(self, max_age_s: float, wait_s: float) -> None:
        """Ask the hub for its load (PING) unless its last report is at most ``max_age_s`` old
        (LoadView.wants_report), and wait up to ``wait_s`` for the PONG; a hub that answers
        later is judged on its last report now, and the PONG still updates it when it comes."""
        if not self.up or not self.placement.wants_report(time.monotonic(), max_age_s, wait_s):
            return
        self._reported.clear()
        self._ping()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reported.wait(), wait_s)

    def _ping(self) -> None:
        nonce = self.placement.ping(next(self._refs), time.monotonic(), self.heartbeat_s)
        if nonce is not None:
            self._send_soon(Ping(nonce))

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

    @property
    def max_gamma(self) -> int:
        """The most draft tokens a proposal of this hub may carry (its WELCOME, clamped)."""
        return self.welcome.max_gamma if self.welcome is not None else limits.MAX_GAMMA

    @property
    def tree_nodes(self) -> int:
        """The most nodes a token tree from this hub may hold: the smaller of what this target
        announced and what the hub offered in WELCOME (clamped); 0 (chains only) while down."""
        offered = self.welcome.tree_nodes if self.welcome is not None else 0
        return max(0, min(self.info.tree_nodes, offered))

    def strike(self, reason: str) -> None:
        """The hub sent something no honest hub sends (a proposal the target refuses, an
        unexpected error): place no session on it for a while, doubling with each strike."""
        self._strikes += 1
        hold = min(STRIKE_MAX_S, STRIKE_BASE_S * 2 ** (self._strikes - 1))
        self._set_aside_until = time.monotonic() + hold
        if self._throttle.allow("strike") is not None:
            log.warning(
                "hub %s misbehaved (%s): no new sessions there for %.0f s (strike %d)",
                self.endpoint,
                printable(reason),
                hold,
                self._strikes,
            )

    def set_aside(self) -> bool:
        """Whether the hub is being avoided after a strike."""
        return time.monotonic() < self._set_aside_until

    async def connect(self, timeout: float = 10.0) -> Welcome:
        """First HELLO/WELCOME; raises HubError if refused, HubUnavailable if no answer.

        With CURVE a rejected key raises curve_client.HandshakeRejected within a second. Either
        way the liveness tasks keep running, so a hub that comes up later is picked up.
        """
        if self._watch is not None:
            await self._watch.wait(timeout_s=min(timeout, 1.0))
        self._tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._liveness_loop()),
        ]
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
            raise HubError(reply.code, printable(reply.message))
        assert isinstance(reply, Welcome)
        if self.welcome is None or reply.epoch != self.welcome.epoch or not self.up:
            reply = self._check_welcome(reply)
            self._welcomed(reply)
        return self.welcome or reply

    def _welcomed(self, welcome: Welcome) -> None:
        self.welcome = self.announced = welcome
        self.generation += 1
        self.heartbeat_s = welcome.heartbeat_ms / 1000
        self.last_heard = time.monotonic()
        self.placement.welcomed(HubLoad.of(welcome), self.last_heard)
        self._reported.set()
        log.info(
            "connected to hub %s at %s (draft %s, gamma %d, generation %d, %d sessions)",
            welcome.epoch.hex(),
            self.endpoint,
            printable(welcome.model),
            welcome.default_gamma,
            self.generation,
            self.placement.load.sessions,
        )

    def _check_welcome(self, welcome: Welcome) -> Welcome:
        # The hub checks too; checking here as well means a lax or old hub cannot slip through.
        hello = self._hello_msg()
        problems = protocol.compatibility_problems(welcome, hello) or tap_problem(
            protocol.feature_taps(welcome), self.info.layers
        )
        if problems:
            raise HubError(ErrorCode.INCOMPATIBLE, printable(problems, 400))
        welcome, changed = checked_welcome(welcome)
        if changed:
            log.warning(
                "hub %s announced values out of range, clamped: %s",
                self.endpoint,
                ", ".join(changed),
            )
        return welcome

    def _hello_msg(self) -> Hello:
        info = self.info
        return Hello(
            info.model,
            info.vocab_size,
            info.tokenizer,
            feature_width=info.feature_width,
            tree_nodes=info.tree_nodes,
        )

    def mark_down(self, reason: str) -> None:
        """Stop using the hub until a new WELCOME; sessions of this generation are void, and
        each waiting sequence hears so at once (it re-opens elsewhere or decodes alone)."""
        if self.welcome is None:
            return
        log.warning(
            "hub %s unavailable (%s): its sessions move to another hub or decode alone",
            self.endpoint,
            reason,
        )
        self.welcome = None
        self.down_since = time.monotonic()
        self._routes.void(f"hub {self.endpoint} is down: {reason}")

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            silent = time.monotonic() - self.last_heard
            if self.up and silent > protocol.LIVENESS_INTERVALS * self.heartbeat_s:
                self.mark_down(f"nothing heard for {silent:.1f} s")
            if self.up:
                self._ping()
            else:
                await self._try_rejoin()

    async def _try_rejoin(self) -> None:
        try:
            await self._handshake(self.heartbeat_s)
        except HubUnavailable:
            pass
        except HubError as exc:
            if self._throttle.allow("refused") is not None:
                log.error("hub %s refused this target: %s", self.endpoint, exc)

    @property
    def needed_taps(self) -> tuple[int, ...]:
        """The target hidden states the hub drafts from (() none; WELCOME was checked): OPEN
        and DRAFT must carry them."""
        return () if self.welcome is None else protocol.feature_taps(self.welcome)

    @property
    def announced_taps(self) -> tuple[int, ...]:
        """:attr:`needed_taps` of the last WELCOME, while down too."""
        return () if self.announced is None else protocol.feature_taps(self.announced)

    async def open(
        self,
        prompt: list[int],
        params: SamplingParams,
        gamma: int,
        timeout: float = 10.0,
        features: np.ndarray | None = None,
    ) -> tuple[bytes, Inbox]:
        """Open a session; returns its tag and the queue its proposals arrive on.

        Raises HubUnavailable after ``timeout`` (an OPENED arriving later is closed at once).
        """
        ref = next(self._refs)
        inbox = self._routes.expect(ref)
        offered = self.welcome.push if self.welcome is not None else 0
        msg = Open(
            ref,
            np.asarray(prompt, dtype=np.int32),
            params,
            gamma,
            features,
            push=push_for(params, self.info.push, offered),
        )
        try:
            await transport.send(self.sock, msg)
            reply = await asyncio.wait_for(inbox.get(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._close_unclaimed(inbox)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise HubUnavailable(f"no OPENED within {timeout:.2f} s") from None
        finally:
            self._routes.forget(ref)
        if isinstance(reply, Error):
            raise HubError(reply.code, printable(reply.message))
        if not isinstance(reply, Opened):  # e.g. a proposal ahead of its OPENED
            self._close_unclaimed(inbox)
            raise HubError(ErrorCode.UNEXPECTED, f"{type(reply).__name__} before OPENED")
        return reply.tag, inbox

    async def draft(
        self,
        tag: bytes,
        seq: int,
        accepted: int,
        appended: list[int],
        features: np.ndarray | None = None,
        taken: int = 0,
        path: Sequence[int] | None = None,
        others_s: float = 0.0,
        forward_s: float = 0.0,
    ) -> None:
        """Send the verdict on proposal ``seq - 1`` and ask for proposal ``seq`` (or, with
        ``taken``, say that the pushed branch of that many tokens is proposal ``seq``).
        ``path``: the accepted path's nodes when proposal ``seq - 1`` was a token tree (empty
        when none was accepted); None after a chain (Draft.path absent). ``others_s``: the
        seconds the model spent on forwards that did not carry this sequence since proposal
        ``seq - 1`` arrived;
        ``forward_s``: the mean seconds of the forwards that carried this sequence since."""
        ids = np.asarray(appended, dtype=np.int32)
        nodes = None if path is None else np.asarray(path, dtype=np.int32).reshape(-1)
        times = {"others_us": timing_us(others_s), "forward_us": timing_us(forward_s)}
        self._routes.grant(tag, 0 if taken else 1)
        await transport.send(
            self.sock, Draft(tag, seq, accepted, ids, features, taken, nodes, **times)
        )

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
        self._routes.forget(tag)
        await transport.send(self.sock, Close(tag))

    async def aclose(self) -> None:
        """Stop the background tasks (for good: :func:`transport.cancel_and_wait`) and close
        the socket."""
        await transport.cancel_and_wait(self._tasks)
        if self._watch is not None:
            self._watch.close()
        self.sock.close(linger=CLOSE_LINGER_MS)

    async def _read_loop(self) -> None:
        read = 0
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            read += 1
            if read % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # zmq.asyncio returns ready messages without yielding
            if not self._budget.take(_BUDGET_KEY, len(self._routes)):
                self._drop("over its budget")
                continue
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as exc:
                self._drop(f"undecodable: {exc}")
                continue
            if self._route(msg):
                self._budget.refund(_BUDGET_KEY)

    def _drop(self, why: str) -> None:
        self.dropped += 1
        held = self._throttle.allow(("drop", why[:24]))
        if held is not None:
            log.warning(
                "dropped a message from hub %s: %s (%d more since the last such line)",
                self.endpoint,
                printable(why),
                held,
            )

    def _route(self, msg: protocol.Message) -> bool:
        """Handle one message; True if it was asked for (refunded from the budget)."""
        if isinstance(msg, Welcome):
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)
                return True
            return False
        if self._stale(msg):
            return False
        self.last_heard = time.monotonic()
        return self._dispatch(msg)

    def _stale(self, msg: protocol.Message) -> bool:
        """A reply from another hub process than the one we were welcomed by."""
        epoch = getattr(msg, "epoch", b"")
        if not epoch or self.welcome is None or epoch == self.welcome.epoch:
            return False
        self.mark_down("the hub restarted (new epoch)")
        return True

    def _dispatch(self, msg: protocol.Message) -> bool:
        match msg:
            case Opened(ref=ref, tag=tag):
                return self._opened(ref, tag, msg)
            case Proposal(tag=tag):
                return self._proposal(tag, msg)
            case Error(code=code, tag=None, ref=None) if code in _HUB_LOST:
                self._hub_lost(msg)
            case Error(tag=bytes() as tag):
                self._deliver(tag, msg)
            case Error(ref=int() as ref):
                return self._deliver(ref, msg)  # the answer to an OPEN
            case Error() if self._hello and not self._hello.done():
                self._hello.set_result(msg)
            case Stats(nonce=nonce) if nonce in self._stats:
                if not self._stats[nonce].done():
                    self._stats[nonce].set_result(msg)
                return True
            case Ping(nonce=nonce):
                self._send_soon(Pong(nonce))
            case Pong(nonce=nonce) if nonce == self.placement.nonce:
                self.placement.ponged(nonce, HubLoad.of(msg), time.monotonic())
                self._reported.set()
                return True
            case _:
                self._drop(f"unexpected {type(msg).__name__}")
        return False

    def _proposal(self, tag: bytes, msg: Proposal) -> bool:
        """A proposal or pushed branch for a session of ours, within what it asked for."""
        if not self._routes.spend(tag):
            self._drop("a proposal nobody asked for")
            return False
        self._deliver(tag, msg)
        return True

    def _opened(self, ref: int, tag: bytes, msg: Opened) -> bool:
        # Route the tag before anything else is read: PROPOSAL seq 0 may be next.
        known = self._routes.known(tag)
        inbox = self._routes.open_session(ref, tag)
        if inbox is None:  # its OPEN timed out, or a second OPENED
            if not known:
                self._send_soon(Close(tag))  # nobody wants this session (never one of ours)
            return False
        self._put(inbox, msg)
        return True

    def _close_unclaimed(self, inbox: Inbox) -> None:
        """Close a session whose OPENED reached the inbox but not the caller (it timed out or
        was cancelled at that moment, e.g. an HTTP client went away): else it would stay open
        on the hub until this target's lease ends."""
        for tag in self._routes.unclaimed(inbox):
            self._send_soon(Close(tag))

    def _hub_lost(self, msg: Error) -> None:
        if self._hello is not None and not self._hello.done():
            self._hello.set_result(msg)
        self.mark_down(f"{msg.code}: {msg.message}")

    def _send_soon(self, msg: protocol.Message) -> None:
        """Send without waiting (the event loop's callbacks cannot await); a hub that does not
        read gets nothing rather than a growing queue of sends."""
        if not transport.send_nowait(self.sock, msg):
            self._drop(f"could not send {type(msg).__name__}: the hub is not reading")

    def _deliver(self, key: int | bytes, msg: protocol.Message) -> bool:
        inbox = self._routes.inbox(key)
        if inbox is None:
            log.debug("dropped %s for a finished sequence", type(msg).__name__)
            return False
        return self._put(inbox, msg)

    def _put(self, inbox: Inbox, msg: protocol.Message) -> bool:
        try:
            inbox.put_nowait(msg)
        except asyncio.QueueFull:
            self._drop(f"a sequence's inbox is full ({type(msg).__name__})")
            return False
        return True
