"""What the hub says about itself: its start line, its stats lines and its STATS reply.

Pure reads of the session table and the counters; the callers hold the hub's lock where the
table or the counters are shared (:mod:`starsd.hub.server`).
"""

from __future__ import annotations

import time
from typing import TypedDict

from starsd import protocol
from starsd.hub.config import HubConfig
from starsd.hub.sessions import SessionTable
from starsd.protocol import Stats
from starsd.stats import HubStats


class LoadReport(TypedDict):
    """The load fields of WELCOME and PONG (see :func:`load`)."""

    sessions: int
    queue: int
    busy: float


def load(table: SessionTable, queued: int, stats: HubStats) -> LoadReport:
    """The load a hub reports (lock held): open sessions, jobs in Q_in and the drafting
    thread's recent busy fraction; targets place new sessions by it."""
    return {"sessions": len(table.sessions), "queue": queued, "busy": round(stats.busy_recent(), 3)}


def start_line(
    config: HubConfig, endpoint: str, model: str, allowed: int | None, epoch: bytes
) -> str:
    """The INFO line a hub logs once listening (``allowed``: CURVE's allowed keys, None in
    plain text)."""
    mode = (
        f"CURVE, {allowed} allowed target keys"
        if allowed is not None
        else "plain text, NOT encrypted or authenticated"
    )
    gamma = f"auto from {config.default_gamma}" if config.auto_gamma else str(config.gamma)
    return (
        f"hub listening on {endpoint} ({mode}; draft {model}, gamma {gamma} of max "
        f"{config.max_gamma}, epoch {epoch.hex()})"
    )


def stats_lines(table: SessionTable, stats: HubStats, replies_dropped: int) -> list[str]:
    """The hub's line and one per target that has been served (lock held)."""
    hub = stats.line(len(table.sessions), len(table.peers))
    lines = [f"{hub} replies_dropped={replies_dropped}"]
    return lines + [peer.stats.line() for peer in table.peers.values() if peer.stats.jobs]


def snapshot(table: SessionTable, stats: HubStats, nonce: int = 0) -> Stats:
    """Hub-wide counters since start, as sent in reply to STATS_REQUEST (lock held)."""
    peers = [p.stats for p in table.peers.values()]
    return Stats(
        nonce=nonce,
        wall_s=time.perf_counter() - stats.started,
        busy_s=stats.busy_now(),
        jobs=stats.jobs,
        batches=stats.batches,
        sessions=len(table.sessions),
        targets=len(table.peers),
        rounds=sum(s.rounds for s in peers),
        proposed=sum(s.proposed for s in peers),
        accepted=sum(s.accepted for s in peers),
        queue_wait_s=sum(s.queue_wait_s for s in peers),
        **protocol.curve_arrays(stats.service_totals()),
    )
