"""Per-peer message budgets and log hygiene: pure units, injected clocks."""

from __future__ import annotations

from starsd.budget import PeerBudget, Rates
from starsd.logsafe import Throttle, printable


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _drain(budget: PeerBudget, peer: bytes, sessions: int, tries: int) -> int:
    return sum(budget.take(peer, sessions) for _ in range(tries))


def test_a_flooding_peer_gets_its_burst_then_its_rate_and_no_one_else_pays() -> None:
    """Catches: no budget (a flood handled in full), one budget shared by all peers (the
    flooder spends the legitimate target's share), or a bucket that never refills."""
    clock = Clock()
    budget = PeerBudget(Rates(base_per_s=100, per_session_per_s=50, burst_s=1.0), clock)
    assert _drain(budget, b"flood", 0, 1000) == 100  # the burst: one second of its rate
    assert _drain(budget, b"legit", 2, 150) == 150  # 100 + 2 * 50 per second, untouched
    clock.now += 0.5
    assert _drain(budget, b"flood", 0, 1000) == 50  # refilled at 100/s, not more
    clock.now += 100
    assert _drain(budget, b"flood", 0, 1000) == 100  # capped at the burst, however long idle


def test_prune_forgets_only_idle_peers() -> None:
    """Catches: a budget table that grows with every connection ever seen, or a prune that
    resets a flooder mid-flood (handing it a fresh burst)."""
    clock = Clock()
    budget = PeerBudget(Rates(base_per_s=10), clock)
    _drain(budget, b"old", 0, 5)
    clock.now += 11
    _drain(budget, b"busy", 0, 50)
    assert budget.prune(idle_s=10) == 1
    assert _drain(budget, b"busy", 0, 50) == 0  # still spent


def test_printable_escapes_what_could_forge_a_log_line() -> None:
    """Catches: newlines, carriage returns and ANSI escapes from a peer written verbatim (a
    forged '... starsd.hub INFO ...' line), and unbounded peer strings in the log."""
    forged = "x\n2026-11-30 12:00:00 starsd.hub INFO FORGED\r\x1b[2J"
    out = printable(forged)
    assert "\n" not in out and "\r" not in out and "\x1b" not in out
    assert "\\n2026" in out and "\\x1b" in out
    assert len(printable("a" * 10_000, limit=50)) == 50
    assert printable(b"\x00bytes") == "b'\\x00bytes'"


def test_throttle_lets_one_line_through_per_interval_and_counts_the_rest() -> None:
    """Catches: one log line per dropped reply (166k lines under a flood), or a throttle that
    silences a key for good or mixes keys."""
    clock = Clock()
    quiet = Throttle(10.0, clock)
    assert quiet.allow("a") == 0
    assert [quiet.allow("a") for _ in range(5)] == [None] * 5
    assert quiet.allow("b") == 0
    clock.now += 10
    assert quiet.allow("a") == 5


def test_accepted_work_is_refunded_so_a_fast_target_is_never_cut() -> None:
    """Catches: a budget that counts accepted DRAFTs, which would cut a fast target's rounds
    (a null-drafter round trip runs thousands per second), and a refund past the burst."""
    clock = Clock()
    budget = PeerBudget(Rates(base_per_s=10, per_session_per_s=0, burst_s=1.0), clock)
    for _ in range(5000):
        assert budget.take(b"fast", 1)
        budget.refund(b"fast")
    assert _drain(budget, b"fast", 1, 100) == 10  # refunds never raised it past the burst
    off = PeerBudget(Rates(enabled=False), clock)
    assert _drain(off, b"x", 0, 10_000) == 10_000
