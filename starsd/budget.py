"""Each peer's share of a reader: a token bucket per connection, used on both sides.

The hub keeps one per target connection (:mod:`starsd.hub.server`), a target one per hub
(:mod:`edge.client`), each with its own :class:`Rates`. On the hub: a peer that sends faster
than any target needs (a PING flood, thousands of bad frames) has its excess dropped before it
is decoded or answered, so it costs the hub a receive and a dictionary look-up, and the other
targets' messages keep flowing. libzmq already reads the connections in turn (a ROUTER
fair-queues its input pipes), and its receive high-water mark stops reading a connection whose
queue is full, so a flood backs up in the flooder's own TCP connection.

Every message is charged, and a DRAFT that the session table accepts is refunded: accepted
verdicts are bounded already (one per delivered proposal), so a fast target's rounds never
count, only what costs the hub without granting work (PINGs, OPEN/CLOSE, refused requests).
The rate grows with the sessions a peer holds; a legitimate target (one PING per heartbeat,
OPENs and CLOSEs as its sequences start and end) stays far below it. On a target the same
rule holds in the other direction: what it asked for (a proposal or pushed branch it waits for,
the PONG to its PING, an OPENED) is refunded, and only unsolicited traffic counts. Pure, with an
injectable clock; the hub calls it under its lock, a target on its event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """Messages per second a peer may send, and the burst it may save up."""

    base_per_s: float = 50.0  # HELLO, PINGs (one per heartbeat), STATS, OPENs, CLOSEs
    per_session_per_s: float = 50.0  # refused or duplicate requests of its sessions
    burst_s: float = 5.0  # seconds of its rate a peer may send at once (a 250-OPEN start)
    enabled: bool = True  # off: nothing is dropped (benchmarks of the bare message path)


class PeerBudget:
    """Token buckets by routing id; ``take`` says whether one more message may be handled."""

    def __init__(self, rates: Rates = Rates(), clock: Callable[[], float] = time.monotonic) -> None:
        self.rates = rates
        self.clock = clock
        self._buckets: dict[bytes, tuple[float, float]] = {}  # routing id -> (tokens, at)

    def take(self, peer: bytes, sessions: int) -> bool:
        """Spend one message of ``peer``'s budget (it holds ``sessions``); False when spent."""
        if not self.rates.enabled:
            return True
        rate = self.rates.base_per_s + self.rates.per_session_per_s * sessions
        cap = rate * self.rates.burst_s
        now = self.clock()
        tokens, at = self._buckets.get(peer, (cap, now))
        tokens = min(cap, tokens + (now - at) * rate)
        if tokens < 1.0:
            self._buckets[peer] = (tokens, now)
            return False
        self._buckets[peer] = (tokens - 1.0, now)
        return True

    def refund(self, peer: bytes) -> None:
        """Give back the message just taken: it turned out to be granted work."""
        if peer in self._buckets:
            tokens, at = self._buckets[peer]
            self._buckets[peer] = (tokens + 1.0, at)

    def prune(self, idle_s: float = 10.0) -> int:
        """Forget buckets untouched for ``idle_s`` (they would be full again anyway)."""
        now = self.clock()
        idle = [p for p, (_, at) in self._buckets.items() if now - at > idle_s]
        for peer in idle:
            del self._buckets[peer]
        return len(idle)
