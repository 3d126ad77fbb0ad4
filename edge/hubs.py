"""Several hubs for one target: which ones serve it, and where each new session goes.

The hubs are independent (no shared state, as the ZeroMQ guide's Paranoid Pirate workers): the
target keeps one :class:`~edge.client.HubClient` per hub, each with its own liveness, and the
pool only chooses. A hub that refuses this target (another vocabulary or tokenizer, a key it does
not allow) is logged and left out; the others serve. A hub that cannot be reached yet stays in
the pool: its client keeps saying HELLO and the hub gets sessions once it answers.

Placement: a new session goes to the live hub that holds the fewest sessions (least
connections, as HAProxy's ``leastconn``), counted from the load each hub reports in WELCOME and
in every PONG (:class:`edge.handshake.HubLoad`): its open sessions and queued jobs, plus the
sessions this target placed there since that report (placed but not yet counted: without them a
burst of opens would all land on one hub). A slower hub keeps its sessions longer, so it holds
more of them and gets fewer new ones: the rule balances unequal hubs without knowing their
speeds. The hub's busy fraction is not used: it is a mean over a window of seconds, so it lags
the session count, and a batched hub's cost grows far slower than its sessions (S(B)), so
``busy / sessions`` as one session's price makes the busier hub look the roomier. Measured with
two hubs, that price sent the whole fleet from one hub to the other every few seconds.

Hubs holding within ``NEAR`` (or one session) of the fewest count as tied: among them the one
this target has placed fewest sessions on wins, then a random order drawn once per target.
Without that, many targets that start together see the same reports and all pick the same hub
(a herd: measured with 64 emulated targets, every session on one of two idle hubs), and the
reports only catch up after the sessions are placed for good.

Before each placement the pool asks every live hub whose report is older than
``REPORT_MAX_AGE_S`` for a fresh one (a PING, answered by the hub's event loop, not its drafting
thread) and waits up to ``REPORT_WAIT_S`` (a hub whose PING is already that late is judged on its
last report, so a hub that does not answer delays one placement per PING, not each one): one
round trip per new session, against reports a heartbeat old, in which the sessions every other
target placed since are missing. Measured with 64 emulated targets on two hubs, heartbeat-old
reports let the fleet's new sessions pile onto whichever hub last looked emptier, swinging both
hubs between 14 and 51 sessions.

Sessions never move while their hub is healthy: only a hub that dies, drains or restarts sends
its sessions back here for a new place (edge.speculate).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re

import zmq.asyncio

from edge.backends.base import ModelInfo
from edge.client import HubClient
from edge.handshake import HubError, HubUnavailable, TargetInfo
from edge.verifier import announced_tree_nodes
from starsd import curve_client, protocol

log = logging.getLogger("edge.hubs")

NEAR = 0.2  # sessions within this fraction of the fewest (or within one) count as a tie
REPORT_MAX_AGE_S = 0.05  # a load report older than this is asked afresh before a placement
REPORT_WAIT_S = 0.1  # how long a placement waits for those reports (a late hub: its last one)
_ENDPOINT = re.compile(r"^(tcp://(\[[0-9a-fA-F:.]+\]|[^:/\s\[\]]+):\d{1,5}|ipc://\S+)$")


def parse_hub_endpoints(text: str) -> tuple[str, ...]:
    """The hub endpoints of ``--hub`` (comma separated); ValueError names what is wrong:
    an empty entry, a duplicate, or an endpoint that is not ZeroMQ ``tcp://HOST:PORT`` or
    ``ipc://PATH``."""
    entries = [entry.strip() for entry in text.split(",")]
    for entry in entries:
        _check_endpoint(entry)
    duplicates = sorted({entry for entry in entries if entries.count(entry) > 1})
    if duplicates:
        raise ValueError(f"hub endpoint listed twice: {', '.join(duplicates)}")
    return tuple(entries)


def _check_endpoint(entry: str) -> None:
    if not entry:
        raise ValueError("empty entry in the hub list (a stray comma?)")
    if not _ENDPOINT.match(entry):
        raise ValueError(f"{entry!r} is not a ZeroMQ endpoint (tcp://HOST:PORT or ipc://PATH)")
    port = entry.rsplit(":", 1)[1]
    if entry.startswith("tcp://") and not 1 <= int(port) <= 65535:
        raise ValueError(f"{entry!r}: port {port} is out of range")


class HubPool:
    """The hubs one target uses; :meth:`pick` places each new session.

    Owned by the event loop (like the clients): no lock.
    """

    def __init__(self, clients: list[HubClient], rng: random.Random | None = None) -> None:
        """``rng`` draws this target's order among tied hubs (default: seeded from the OS)."""
        self.clients = list(clients)
        rng = rng or random.Random()
        self._order = {id(client): rng.random() for client in self.clients}

    @classmethod
    def create(
        cls,
        ctx: zmq.asyncio.Context,
        endpoints: tuple[str, ...],
        info: TargetInfo,
        curves: list[curve_client.CurveClientConfig | None] | None = None,
    ) -> HubPool:
        """One client (DEALER socket) per hub endpoint, with that hub's CURVE settings if any;
        nothing is sent before :meth:`connect`."""
        curves = curves or [None] * len(endpoints)
        pairs = zip(endpoints, curves, strict=True)
        return cls([HubClient(ctx, endpoint, info, curve) for endpoint, curve in pairs])

    @classmethod
    def for_model(
        cls,
        ctx: zmq.asyncio.Context,
        endpoints: tuple[str, ...],
        model: ModelInfo,
        push: int,
        curves: list[curve_client.CurveClientConfig | None] | None = None,
    ) -> HubPool:
        """:meth:`create` for a target running ``model`` (what HELLO says of it: token trees
        when its backend verifies them), whose sessions take ``push`` pushed branches per
        round."""
        info = TargetInfo(
            model.name,
            model.vocab_size,
            model.tokenizer_fingerprint,
            model.hidden_size,
            push,
            model.layers,
            announced_tree_nodes(model),
        )
        return cls.create(ctx, endpoints, info, curves)

    @property
    def up(self) -> bool:
        """Whether at least one hub serves this target now."""
        return any(client.up for client in self.clients)

    def feature_taps(self) -> tuple[int, ...]:
        """The hidden states new sequences should keep: every tap some hub drafts from (EAGLE),
        and the last one (EAGLE-1's) for a hub that has never said what it drafts from."""
        needed = (c.announced_taps if c.announced is not None else (-1,) for c in self.clients)
        return tuple(dict.fromkeys(t for taps in needed for t in taps))

    def live(self) -> list[HubClient]:
        """The hubs serving this target now."""
        return [client for client in self.clients if client.up]

    async def connect(self, timeout: float = 10.0) -> int:
        """HELLO to every hub at once; returns how many welcomed this target.

        A hub that refuses is logged with its reason and dropped; a hub that does not answer in
        time stays (its client keeps trying). Raises the refusal if every hub refused, and
        HubUnavailable if none answered (the target then decodes alone until one does).
        """
        results = await asyncio.gather(
            *(c.connect(timeout) for c in self.clients), return_exceptions=True
        )
        refusals = [await self._refused(c, r) for c, r in zip(self.clients, results, strict=True)]
        self.clients = [
            c for c, refused in zip(self.clients, refusals, strict=True) if refused is None
        ]
        if not self.clients:
            raise next(r for r in refusals if r is not None)
        welcomed = sum(isinstance(r, protocol.Welcome) for r in results)
        if not welcomed:
            raise HubUnavailable(f"none of {len(self.clients)} hubs answered in {timeout:.1f} s")
        log.info("%d of %d hubs serve this target", welcomed, len(results))
        return welcomed

    async def _refused(self, client: HubClient, result: object) -> BaseException | None:
        """The refusal in ``result`` (the client is then closed), or None: welcomed or late."""
        if isinstance(result, HubUnavailable):
            log.warning("hub %s: %s; it gets sessions once it answers", client.endpoint, result)
            return None
        refusal = _refusal(result)
        if refusal is not None:
            log.error("hub %s refused this target, not using it: %s", client.endpoint, refusal)
            await client.aclose()
        return refusal

    def pick(self, taps: tuple[int, ...] = (-1,)) -> HubClient | None:
        """The live hub holding the fewest sessions (see the module docstring), counted as
        holding one more session of ours from now on; None when no hub is live. Hubs that are
        full or set aside after misbehaving (HubClient.strike) are left out, and so are EAGLE
        hubs that draft from hidden states not among ``taps`` (those the sequence keeps)."""
        live = [
            client
            for client in self.live()
            if not client.full() and not client.set_aside() and set(client.needed_taps) <= set(taps)
        ]
        if not live:
            return None
        holds = {id(c): c.placement.load.holds(c.placement.since_report) for c in live}
        fewest = min(holds.values())
        tied = [c for c in live if holds[id(c)] <= fewest + max(1.0, NEAR * fewest)]
        chosen = min(tied, key=lambda c: (c.placement.placed, self._order.get(id(c), 0.0)))
        chosen.placement.placed += 1
        return chosen

    async def refresh(
        self, max_age_s: float = REPORT_MAX_AGE_S, wait_s: float = REPORT_WAIT_S
    ) -> None:
        """Fresh load reports from the live hubs before a placement (see the module docstring);
        with one live hub there is no choice to make, so nothing is asked."""
        live = [client for client in self.live() if not client.set_aside()]
        if len(live) > 1:
            await asyncio.gather(*(client.fresh_load(max_age_s, wait_s) for client in live))

    async def aclose(self) -> None:
        """Close every hub's client."""
        await asyncio.gather(*(client.aclose() for client in self.clients))


def _refusal(result: object) -> BaseException | None:
    if isinstance(result, (HubError, curve_client.HandshakeError)):
        return result
    if isinstance(result, BaseException):
        raise result  # a bug, not a hub's answer
    return None
