"""What a target says of itself in HELLO and what it accepts of a hub's WELCOME (every number
clamped or refused), the load a hub reports, and the errors a hub connection raises; pure, no
socket (the connection: :mod:`edge.client`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from starsd import limits, protocol
from starsd.logsafe import printable
from starsd.protocol import ErrorCode, SamplingParams, Welcome


class HubError(RuntimeError):
    """The hub answered with ERROR (or could not be understood)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"hub error {code}: {message}")
        self.code = code


class HubUnavailable(HubError):
    """No usable answer from the hub in time; the caller decodes without it."""

    def __init__(self, message: str) -> None:
        super().__init__("UNAVAILABLE", message)


HEARTBEAT_MS_RANGE = (100, 60_000)  # a WELCOME's heartbeat is clamped into this


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

    def holds(self, placed: int) -> int:
        """Sessions the hub holds or soon will: its open sessions, its queued jobs (rounds it
        is already late on) and ``placed`` sessions of ours not yet in this report."""
        return self.sessions + self.queue + placed


class LoadView:
    """This target's view of one hub's load, which edge.hubs places sessions by: the hub's last
    report (WELCOME or the PONG to our PING), the sessions placed there in all, how many of them
    that report saw, and the PING awaiting its PONG. Owned by the event loop (pure: the client
    sends and receives)."""

    def __init__(self) -> None:
        self.load = HubLoad()
        self.placed = 0  # sessions this target placed on the hub (less those that failed to open)
        self.reported_at = -math.inf  # time.monotonic() of the last report
        self.nonce: int | None = None  # the PING awaiting its PONG
        self._pinged_at = -math.inf
        self._placed_at_ping = 0
        self._placed_reported = 0

    @property
    def since_report(self) -> int:
        """Sessions placed on the hub that its last report does not count yet."""
        return self.placed - self._placed_reported

    def welcomed(self, load: HubLoad, now: float) -> None:
        """A WELCOME's load, which counts every session placed so far."""
        self._take(load, self.placed, now)

    def wants_report(self, now: float, max_age_s: float, wait_s: float) -> bool:
        """Whether a placement should ask for (or wait on) a fresh report: the last one is
        older than ``max_age_s`` and no PING is already late by more than ``wait_s`` (a hub that
        does not answer costs a placement ``wait_s`` once per PING, not every placement)."""
        late = self.nonce is not None and now - self._pinged_at > wait_s
        return now - self.reported_at > max_age_s and not late

    def ping(self, nonce: int, now: float, reuse_s: float) -> int | None:
        """The nonce of a PING to send now, or None while one sent less than ``reuse_s`` ago
        still awaits its PONG (a second one would only make the first PONG look unsolicited)."""
        if self.nonce is not None and now - self._pinged_at < reuse_s:
            return None
        self.nonce, self._pinged_at, self._placed_at_ping = nonce, now, self.placed
        return nonce

    def ponged(self, nonce: int, load: HubLoad, now: float) -> bool:
        """Take a PONG's load if it answers our PING; False for any other PONG."""
        if nonce != self.nonce:
            return False
        self.nonce = None
        self._take(load, self._placed_at_ping, now)
        return True

    def _take(self, load: HubLoad, placed_seen: int, now: float) -> None:
        self.load, self._placed_reported, self.reported_at = load, placed_seen, now


@dataclass(frozen=True)
class TargetInfo:
    """What the target tells the hub in HELLO."""

    model: str
    vocab_size: int
    tokenizer: str
    feature_width: int = 0  # > 0: this target can send its features (for EAGLE hubs)
    push: int = 0  # pushed branches per round its sessions take (Open.push; 0: none)
    # not sent: L when it can tap every hidden state 0..L (EAGLE-3), 0 only its last one
    layers: int = 0
    # > 0: it verifies token trees of up to this many nodes (Hello.tree_nodes; 0: chains only)
    tree_nodes: int = 0


def push_for(params: SamplingParams, push: int, offered: int) -> int:
    """The pushed branches a session asks for: ``push``, at most what the hub ``offered`` in
    WELCOME (0 from a hub that predates pushes: it would refuse an OPEN with the field), and
    none for plain sampling, whose every branch would carry q dense (gamma x V float32: 128 KB
    per 4 branches of 4 tokens at V = 2048, 2 MB at V = 32000) and cost a slow link more than
    the round trip it saves; greedy branches carry no q and top-k / top-p ones only their
    support."""
    return min(push, offered) if params.greedy or params.truncated else 0


def tap_problem(taps: tuple[int, ...], layers: int) -> str:
    """Why a target with ``layers`` tappable layers (0: only its last hidden state) cannot send
    the hidden states ``taps`` ('' if it can; ``taps`` already parsed)."""
    if taps in ((), (-1,)):
        return ""
    if not layers:
        return f"the hub drafts from hidden states {list(taps)}; this target taps only its last"
    if max(taps) > layers:
        return f"the hub drafts from hidden states {list(taps)}; this target has 0..{layers}"
    return ""


def checked_welcome(welcome: Welcome) -> tuple[Welcome, list[str]]:
    """``welcome`` with every number it carries brought into range, and what was changed.

    Raises HubError(INCOMPATIBLE) for what cannot be clamped: another protocol version, an
    epoch of the wrong size, a feature dtype the target cannot send. The heartbeat is clamped
    (a 0 would make the client PING in a tight loop), gammas into 0..limits.MAX_GAMMA, the
    push offer into 0..limits.MAX_PUSH, the tree offer into 0..limits.MAX_TREE_NODES; load
    figures are clamped by :class:`HubLoad`.
    """
    if welcome.version != protocol.PROTOCOL_VERSION:
        raise HubError(ErrorCode.INCOMPATIBLE, f"protocol version {welcome.version}")
    if len(welcome.epoch) != protocol.EPOCH_BYTES:
        raise HubError(ErrorCode.INCOMPATIBLE, f"an epoch of {len(welcome.epoch)} bytes")
    if welcome.feature_width and welcome.feature_dtype not in ("float16", "float32"):
        raise HubError(ErrorCode.INCOMPATIBLE, f"feature dtype {printable(welcome.feature_dtype)}")
    max_gamma = _clamp(welcome.max_gamma, 1, limits.MAX_GAMMA)
    fixed: dict[str, Any] = {
        "heartbeat_ms": _clamp(welcome.heartbeat_ms, *HEARTBEAT_MS_RANGE),
        "max_gamma": max_gamma,
        "default_gamma": _clamp(welcome.default_gamma, 0, max_gamma),
        "push": _clamp(welcome.push, 0, limits.MAX_PUSH),
        "tree_nodes": _clamp(welcome.tree_nodes, 0, limits.MAX_TREE_NODES),
    }
    changed = [
        f"{name} {getattr(welcome, name)} -> {value}"
        for name, value in fixed.items()
        if getattr(welcome, name) != value
    ]
    return replace(welcome, **fixed), changed


def _clamp(value: int, low: int, high: int) -> int:
    return min(high, max(low, value))
