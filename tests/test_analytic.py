"""The analytic model against hand-computed values."""

from __future__ import annotations

import pytest

from starsd import analytic
from starsd.analytic import ModelInputs


def test_expected_tokens_per_round() -> None:
    assert analytic.expected_tokens_per_round(0.5, 4) == pytest.approx(1.9375)  # (1-1/32)/0.5
    assert analytic.expected_tokens_per_round(0.8, 4) == pytest.approx(3.3616)
    assert analytic.expected_tokens_per_round(0.0, 4) == 1.0
    assert analytic.expected_tokens_per_round(1.0, 4) == 5.0
    with pytest.raises(ValueError):
        analytic.expected_tokens_per_round(1.5, 4)


def test_alpha_is_recovered_from_mean_accepted() -> None:
    assert analytic.alpha_from_mean_accepted(0.9375, 4) == pytest.approx(0.5, abs=1e-9)
    assert analytic.alpha_from_mean_accepted(2.3616, 4) == pytest.approx(0.8, abs=1e-9)


# S = 2 ms, verify 5 ms + link 1 ms = R = 6 ms: one target's cycle is 8 ms, N_full = 4.
INPUTS = ModelInputs(alpha=0.5, gamma=4, draft_s=0.002, verify_s=0.005, link_s=0.001,
                     target_step_s=0.004)  # fmt: skip


@pytest.mark.parametrize(
    ("n", "regime", "iteration_ms", "idle_ms", "system", "busy"),
    [
        (1, "under-loaded", 8.0, 6.0, 1.9375 / 0.008, 0.25),
        (2, "under-loaded", 8.0, 4.0, 2 * 1.9375 / 0.008, 0.5),
        (4, "fully-loaded", 8.0, 0.0, 4 * 1.9375 / 0.008, 1.0),
        (8, "fully-loaded", 16.0, 0.0, 1.9375 / 0.002, 1.0),
    ],
)
def test_regimes(n: int, regime: str, iteration_ms: float, idle_ms: float, system: float,
                 busy: float) -> None:  # fmt: skip
    p = analytic.predict(INPUTS, n)
    assert p.regime == regime
    assert p.iteration_s == pytest.approx(iteration_ms / 1e3)
    assert p.idle_s == pytest.approx(idle_ms / 1e3)
    assert p.system_tokens_per_s == pytest.approx(system)
    assert p.per_target_tokens_per_s == pytest.approx(system / n)
    assert p.hub_busy_fraction == pytest.approx(busy)


def test_saturation_and_break_even() -> None:
    """Catches N_full rounded down or to nearest (INPUTS alone gives exactly 4.0, which cannot
    tell), a term left out of S + R, and break-even off by one or its standalone check lost."""
    assert analytic.saturation_point(INPUTS) == 4
    # (2 + 5 + 1.5) / 2 = 4.25 -> 5; floor, round, or S + R without S or the link -> 4
    assert analytic.saturation_point(ModelInputs(0.5, 4, 0.002, 0.005, 0.0015, 0.004)) == 5
    # at alpha 0.5 one target (242 tok/s) is already slower than standalone (250 tok/s)
    assert analytic.break_even_targets(INPUTS) == 0
    fast = ModelInputs(0.8, 4, 0.002, 0.005, 0.001, 0.004)
    assert analytic.break_even_targets(fast) == 6  # floor(3.3616 * 4 / 2)


def test_cli_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    analytic.main(["--alpha", "0.5", "--draft-ms", "2", "--verify-ms", "5", "--link-ms", "1",
                   "--target-step-ms", "4", "--n", "1", "8"])  # fmt: skip
    out = capsys.readouterr().out
    assert "N_full = 4" in out and "| 8 | fully-loaded | 16.00 |" in out
