"""HubStats: the per-batch-size service curve behind STATS and the hub's summary line."""

from __future__ import annotations

import pytest

from starsd.stats import HubStats, curve_summary


def _recorded(batches: list[tuple[int, float]]) -> HubStats:
    stats = HubStats()
    for jobs, seconds in batches:
        stats.record_batch(jobs, seconds, seconds / 2)
    return stats


def test_service_curve_after_record_batch() -> None:
    """Catches batches filed under the wrong size (e.g. all under 1, or under the batch count),
    a mean over all batches instead of per size, unsorted rows, and totals that lose a batch."""
    stats = _recorded([(8, 0.005), (1, 0.004), (8, 0.007), (32, 0.010), (1, 0.002)])
    assert stats.service_totals() == [
        (1, 2, pytest.approx(0.006)),
        (8, 2, pytest.approx(0.012)),
        (32, 1, pytest.approx(0.010)),
    ]
    assert stats.service_curve() == [
        (1, 2, pytest.approx(0.003)),
        (8, 2, pytest.approx(0.006)),
        (32, 1, pytest.approx(0.010)),
    ]
    assert stats.batches == 5 and stats.jobs == 50 and stats.mean_batch == pytest.approx(10.0)
    assert stats.busy_s == pytest.approx(0.028)


def test_summary_line_carries_mean_batch_and_the_curve() -> None:
    """Catches a summary line without the batch figures, or one that prints seconds as ms."""
    line = _recorded([(1, 0.004), (8, 0.0047), (8, 0.0047)]).line(sessions=3, targets=2)
    assert "mean_batch=5.67" in line and "S_ms=1:4.00,8:4.70" in line
    assert "mean_batch=0.00 S_ms=-" in HubStats().line(sessions=0, targets=0)


def test_curve_summary_keeps_both_ends_of_a_long_curve() -> None:
    """Catches a summary that grows with the number of sizes (64 of them at the default
    --max-batch) or that drops the largest batch, the one that says how far batching scales."""
    curve = [(b, 1, 0.001 * b) for b in range(1, 65)]
    pairs = curve_summary(curve).split(",")
    assert len(pairs) == 5 and pairs[0] == "1:1.00" and pairs[-1] == "64:64.00"
    assert curve_summary(curve[:3]) == "1:1.00,2:2.00,3:3.00"
