"""The analytic model against hand-computed values."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from starsd import analytic
from starsd.analytic import ModelInputs
from starsd.analytic import cli as analytic_cli
from starsd.goodput import best_gamma
from starsd.service import ServiceCurve


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
INPUTS = ModelInputs(
    alpha=0.5, gamma=4, draft_s=0.002, verify_s=0.005, link_s=0.001, target_step_s=0.004
)


@pytest.mark.parametrize(
    ("n", "regime", "iteration_ms", "idle_ms", "system", "busy"),
    [
        (1, "under-loaded", 8.0, 6.0, 1.9375 / 0.008, 0.25),
        (2, "under-loaded", 8.0, 4.0, 2 * 1.9375 / 0.008, 0.5),
        (4, "fully-loaded", 8.0, 0.0, 4 * 1.9375 / 0.008, 1.0),
        (8, "fully-loaded", 16.0, 0.0, 1.9375 / 0.002, 1.0),
    ],
)
def test_regimes(
    n: int, regime: str, iteration_ms: float, idle_ms: float, system: float, busy: float
) -> None:
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
    analytic_cli.main(
        [
            "--alpha",
            "0.5",
            "--draft-ms",
            "2",
            "--verify-ms",
            "5",
            "--link-ms",
            "1",
            "--target-step-ms",
            "4",
            "--n",
            "1",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert "N_full = 4" in out and "| 8 | fully-loaded | 16.00 |" in out


# ------------------------------------------------------------------ batching: the curve S(B)


def test_service_curve_interpolates_and_extrapolates() -> None:
    """Catches S(B) read off the nearest point instead of the line between two, a curve that
    drops to zero (or extrapolates downwards) outside its measured sizes, and extrapolation
    from the first two points instead of the last two."""
    curve = _curve((8, 0.005), (32, 0.008), (4, 0.004))  # sorted on the way in
    assert curve.table(4) == ((4, 0.004), (8, 0.005), (32, 0.008))
    cases = {1: 0.004, 4: 0.004, 6: 0.0045, 8: 0.005, 20: 0.0065, 32: 0.008, 64: 0.012}
    for batch, seconds in cases.items():
        assert curve.at(batch, 4) == pytest.approx(seconds), batch
    falling = _curve((1, 0.005), (8, 0.004))  # noise: B = 8 measured cheaper
    assert falling.at(64, 4) == pytest.approx(0.004)  # never below the last measured value
    assert _curve((1, 0.003)).at(64, 4) == pytest.approx(0.003)  # one point: flat
    # measured at gamma 4: one feed and 3 steps of equal cost, so gamma 2 costs half
    assert curve.at(8, 2) == pytest.approx(0.0025) and curve.costs(8, 4)[1:] == pytest.approx(
        [0.00125, 0.0025, 0.00375, 0.005]
    )


def _curve(*points: tuple[int, float], gamma: int = 4) -> ServiceCurve:
    """S(B) measured at ``gamma``, as a benchmark records it."""
    return ServiceCurve.proportional(points, gamma)


def test_a_step_cost_other_than_the_feed_shapes_s_of_gamma() -> None:
    """Catches S(B, g) read as proportional when a(B) and b(B) differ (the hub's own fit),
    and b interpolated from a instead of from the steps."""
    curve = ServiceCurve((1, 9), (0.004, 0.012), (0.001, 0.005))
    assert curve.at(1, 5) == pytest.approx(0.008) and curve.at(5, 3) == pytest.approx(0.014)


def test_service_curve_parse_totals_and_validation() -> None:
    """Catches --curve read as seconds instead of ms, totals not divided by their counts, and
    curves the model cannot use (no point, duplicated or zero sizes, non-positive times)."""
    parsed = ServiceCurve.parse("1:4.3, 8:4.7", 4)
    assert parsed.sizes == (1, 8)
    assert [s for _, s in parsed.table(4)] == pytest.approx([0.0043, 0.0047])
    totals = [(1, 4, 0.02), (8, 0, 0.0), (16, 2, 0.012)]  # (B, batches, summed s); 8: none
    summed = ServiceCurve.from_totals(totals, 4)
    assert summed.sizes == (1, 16)
    assert [s for _, s in summed.table(4)] == pytest.approx([0.005, 0.006])
    for bad in ((), ((0, 0.001),), ((2, 0.001), (2, 0.002)), ((1, 0.0),), ((1, -1.0),)):
        with pytest.raises(ValueError):
            _curve(*bad)
    for text in ("", "1:", "1-4", "x:1", "1:4:5"):
        with pytest.raises(ValueError):
            ServiceCurve.parse(text, 4)
    with pytest.raises(ValueError):
        ModelInputs(0.5, 4, 0.002, 0.005, 0.001, 0.004, max_batch=0)
    with pytest.raises(ValueError):  # a flat S(B) = S(1) is no stand-in for a measured curve
        ModelInputs(0.5, 4, 0.002, 0.005, 0.001, 0.004, max_batch=8)


def _one_at_a_time(inputs: ModelInputs, n: int) -> tuple[float, float]:
    """The model before batching, written out: (T_gamma, T_idle)."""
    busy = n * inputs.draft_s
    idle = max(0.0, inputs.draft_s + inputs.verify_s + inputs.link_s - busy)
    return busy + idle, idle


def test_max_batch_one_is_the_one_at_a_time_model() -> None:
    """Catches a batched model that does not reduce to the old one at M = 1: batches of M = 1
    miscounted (k != N), S(B_1) taken for another size, or a curve's other sizes leaking in."""
    others = ((8, 0.0001), (64, 0.5))  # only S(1) may count
    for draft_s, verify_s, link_s in ((0.002, 0.005, 0.001), (0.0031, 0.0042, 0.0007)):
        plain = ModelInputs(0.7, 4, draft_s, verify_s, link_s, 0.004)
        curved = ModelInputs(
            0.7, 4, draft_s, verify_s, link_s, 0.004, 1, _curve((1, draft_s), *others)
        )
        for inputs in (plain, curved):
            for n in range(1, 41):
                p = analytic.predict(inputs, n)
                iteration, idle = _one_at_a_time(plain, n)
                assert p.iteration_s == pytest.approx(iteration) and p.batches == n
                assert p.idle_s == pytest.approx(idle, abs=1e-12)
            full = math.ceil((draft_s + verify_s + link_s) / draft_s)
            assert analytic.saturation_point(inputs) == full
            assert analytic.break_even_targets(inputs) == analytic.break_even_targets(plain)


# S = 2 ms whatever the batch, R = 6 ms, batches of up to 64
FLAT = ModelInputs(
    0.5, 4, 0.002, 0.005, 0.001, 0.004, max_batch=64, curve=_curve((1, 0.002), (64, 0.002))
)


def test_batching_moves_n_full_out_and_multiplies_the_ceiling() -> None:
    """Catches a model that still saturates at the one-at-a-time N_full (4) or caps system
    throughput at E[L] / S(1): with free batching, N_full = M * ceil(R / s) + 1 and the fully
    loaded ceiling is M times the one-at-a-time hub's E[L] / s."""
    tokens = analytic.expected_tokens_per_round(0.5, 4)
    one_at_a_time = analytic.predict(INPUTS, 1000).system_tokens_per_s
    assert one_at_a_time == pytest.approx(tokens / 0.002)  # its saturation
    assert analytic.saturation_point(FLAT) == 64 * 3 + 1 > FLAT.max_batch
    at_m = analytic.predict(FLAT, 64)  # one batch of 64: under-loaded, a round every s + R
    assert at_m.regime == "under-loaded" and at_m.iteration_s == pytest.approx(0.008)
    assert at_m.system_tokens_per_s == pytest.approx(64 * 0.002 / 0.008 * one_at_a_time)
    full = analytic.predict(FLAT, 4 * 64)  # full batches, hub never idle
    assert full.regime == "fully-loaded" and full.hub_busy_fraction == pytest.approx(1.0)
    assert full.system_tokens_per_s == pytest.approx(64 * one_at_a_time)


# S(B) = 4 ms at B = 1 to 6 ms at B = 8, linear between: S(B) = (26 + 2B) / 7 ms; R = 8 ms
SLOPED = ModelInputs(
    0.5, 4, 0.004, 0.007, 0.001, 0.004, max_batch=8, curve=ServiceCurve.parse("1:4,8:6", 4)
)


def test_idle_boundary_is_exactly_at_n_full() -> None:
    """Catches unequal batches (8 + 1 for N = 9 waits 6 + 8 ms, not S(5) + 8), T_idle taken
    from the smallest batch instead of the largest, and an N_full off by one: 16 targets in
    2 x 8 leave the hub 2 ms idle, 17 in 6 + 6 + 5 keep it busy (112 / 7 = 16 ms of service)."""
    assert analytic.batch_sizes(9, 8) == (5, 4) and analytic.batch_sizes(17, 8) == (6, 6, 5)
    nine = analytic.predict(SLOPED, 9)  # S(5) + S(4) = 10 ms busy; S(5) + R = 92 / 7 ms
    assert nine.iteration_s == pytest.approx(92 / 7e3) and nine.idle_s == pytest.approx(22 / 7e3)
    assert analytic.saturation_point(SLOPED) == 17
    below = analytic.predict(SLOPED, 16)
    assert below.regime == "under-loaded" and below.idle_s == pytest.approx(0.002)
    at = analytic.predict(SLOPED, 17)
    assert at.regime == "fully-loaded" and at.idle_s == 0.0
    assert at.iteration_s == pytest.approx(0.016) and at.batches == 3 and at.largest_batch == 6


def test_break_even_uses_the_curve() -> None:
    """Catches break-even from S(1) alone (6 targets): with 64 jobs per 2 ms batch, T_gamma
    stays within E[L] * T_ar = 13.4 ms up to 6 full batches, 384 targets."""
    fast = dataclasses.replace(FLAT, alpha=0.8)
    assert analytic.break_even_targets(fast) == 6 * 64
    assert analytic.break_even_targets(dataclasses.replace(SLOPED, alpha=0.5)) == 0


def test_inputs_from_bench_reads_old_and_new_json(tmp_path: Path) -> None:
    """Catches a reader that breaks on benchmark JSON from before the curve, drops a recorded
    curve or max batch, or cannot read what dataclasses.asdict writes (the scripts use it)."""
    old = {
        "alpha": 0.7,
        "gamma": 4,
        "draft_s": 0.0055,
        "verify_s": 0.0082,
        "link_s": 0.0011,
        "target_step_s": 0.008,
    }
    cases = {
        "old": (old, ModelInputs(**old)),
        "new": (analytic.inputs_as_json(SLOPED), SLOPED),
        "asdict": (dataclasses.asdict(SLOPED), SLOPED),
        "asdict-plain": (dataclasses.asdict(INPUTS), INPUTS),
    }
    assert analytic.inputs_as_json(SLOPED)["service_curve"] == [[1, 0.004], [8, 0.006]]
    assert "service_curve" not in analytic.inputs_as_json(INPUTS)
    for name, (raw, expected) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"model_inputs": raw}))
        assert analytic.inputs_from_bench(path) == expected, name


def test_cli_prints_the_curve_and_the_new_n_full(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches --curve or --max-batch ignored (N_full would stay 3), the S(B) table missing,
    and --max-batch without a curve accepted as free batching."""
    analytic_cli.main(
        [
            "--alpha",
            "0.5",
            "--verify-ms",
            "7",
            "--link-ms",
            "1",
            "--target-step-ms",
            "4",
            "--curve",
            "1:4,8:6",
            "--n",
            "16",
            "17",
        ]
    )
    out = capsys.readouterr().out
    assert "| 1 | 4.00 | 1.00 | 250 |" in out and "| 8 | 6.00 | 1.50 | 1333 |" in out
    assert "N_full = 17" in out and "| 17 | fully-loaded | 16.00 | 0.00 |" in out
    with pytest.raises(SystemExit):
        analytic_cli.main(["--max-batch", "8"])


# ------------------------------------------------------------------ auto gamma


def test_auto_gamma_for_one_target_is_the_best_fixed_gamma() -> None:
    """Catches S not scaled with gamma (longer would look free: max_gamma), R or T_ar left out
    of the rule, or a rule other than the session's own rate when the hub idles: for one target
    the gamma auto settles at must be the fixed gamma with the most tokens per second."""
    slow_target = ModelInputs(0.8, 4, 0.002, 0.020, 0.001, 0.018)
    gamma, p = analytic.auto_gamma(slow_target, 1)
    rates = {g: analytic.predict_at(slow_target, 1, g).per_target_tokens_per_s for g in range(17)}
    assert gamma == max(rates, key=rates.__getitem__) and gamma >= 5
    assert p.per_target_tokens_per_s == pytest.approx(rates[gamma])
    assert analytic.at_gamma(slow_target, 8).draft_s == pytest.approx(0.004)


def test_a_verify_that_grows_with_gamma_shortens_the_gamma_auto_picks() -> None:
    """Catches R kept constant in gamma where the verify grows per position (a CPU's: the plan
    then charged V(1, 4) at gamma 1 and told a pair that pays 1.1x to decode alone): at_gamma
    moves the verify along ``verify_per_token_s``, and auto gamma is still the best fixed one."""
    flat = ModelInputs(0.8, 4, 0.002, 0.020, 0.001, 0.018)
    steep = dataclasses.replace(flat, verify_per_token_s=0.006)
    assert analytic.at_gamma(steep, 1).verify_s == pytest.approx(0.002)
    assert analytic.at_gamma(steep, 8).verify_s == pytest.approx(0.044)
    gamma, _ = analytic.auto_gamma(steep, 1)
    rates = {g: analytic.predict_at(steep, 1, g).per_target_tokens_per_s for g in range(17)}
    assert gamma == max(rates, key=rates.__getitem__)
    assert gamma < analytic.auto_gamma(flat, 1)[0]


def test_auto_gamma_switches_off_past_break_even() -> None:
    """Catches a model that keeps speculating when every target would be faster alone (the
    hub's gamma 0): past break-even N auto must give each target 1 / T_ar, the hub idle."""
    assert analytic.break_even_targets(INPUTS) == 0  # alpha 0.5: never worth it at gamma 4
    gamma, p = analytic.auto_gamma(INPUTS, 8)
    assert gamma == 0 and p.regime == "alone" and p.hub_busy_fraction == 0.0
    assert p.system_tokens_per_s == pytest.approx(8 / 0.004)
    fast = ModelInputs(0.8, 4, 0.002, 0.005, 0.001, 0.004)
    assert analytic.auto_gamma(fast, 1)[0] >= 1  # one target: speculation pays
    assert analytic.auto_gamma(fast, 64)[0] == 0  # 64 on a one-at-a-time hub: it does not


def test_best_gamma_rule() -> None:
    """Catches the fully loaded branch ranking by the session's own rate (it must rank by
    tokens per hub second among the gammas that still beat T_alone) and ties going long."""
    expected = [analytic.expected_tokens_per_round(0.9, g) for g in range(9)]
    costs = [0.0] + [0.010 + 0.005 * (g - 1) for g in range(1, 9)]
    outside = [0.050] * 9
    idle = best_gamma(expected, costs, outside, 0.040, 64, loaded=False)
    full = best_gamma(expected, costs, outside, 0.040, 64, loaded=True)
    assert idle == 8 and full == 1
    flat = [0.0] + [0.010] * 8
    assert best_gamma([1.0] * 9, flat, outside, None, 1, loaded=False) == 1
    assert best_gamma(expected, costs, outside, 0.001, 64, loaded=True) == 0


def test_cli_gamma_auto_prints_the_chosen_gamma(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches --gamma auto refused, or printing no choice per N."""
    analytic_cli.main(
        [
            "--gamma",
            "auto",
            "--alpha",
            "0.5",
            "--draft-ms",
            "2",
            "--verify-ms",
            "5",
            "--link-ms",
            "1",
            "--target-step-ms",
            "4",
            "--n",
            "1",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert "auto gamma (0..16" in out and "| 8 | 0 | alone | 2000.0 |" in out
    with pytest.raises(SystemExit):
        analytic_cli.main(["--gamma", "often"])


def test_cli_takes_the_verifys_growth_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches --verify-per-token-ms ignored: a verify of 91.5 ms at gamma 4 growing 9.45 ms a
    token (the real pair on this CPU) makes gamma 1 pay (22.0 tok/s against 19.6 alone)."""
    args = "--gamma auto --alpha 0.4 --draft-ms 2.3 --verify-ms 91.5 --target-step-ms 50.9"
    flags = ["--link-ms", "0", "--verify-per-token-ms", "9.45", "--n", "1"]
    analytic_cli.main([*args.split(), *flags])
    out = capsys.readouterr().out
    assert (
        "verify 9.450 ms more per draft token" in out and "| 1 | 1 | under-loaded | 22.0 |" in out
    )


def test_pre_drafting_shortens_idle_rounds_and_changes_nothing_fully_loaded() -> None:
    """Catches a hit rate applied where the hub has no idle time to pre-draft in (a fully loaded
    hub would be predicted faster than its drafting allows), or not applied at all."""
    base = ModelInputs(0.7, 4, 0.010, 0.020, 0.001, 0.010)  # S = 10 ms, R = 21 ms
    hits = dataclasses.replace(base, hit_rate=0.5)
    one = analytic.predict(hits, 1)
    assert one.regime == "under-loaded"
    assert math.isclose(one.iteration_s, 0.5 * 0.010 + 0.021)  # (1 - h) S + R
    ratio = one.per_target_tokens_per_s / analytic.predict(base, 1).per_target_tokens_per_s
    assert math.isclose(ratio, 0.031 / 0.026)
    full = analytic.saturation_point(base)
    assert analytic.predict(hits, full) == analytic.predict(base, full)
    assert analytic.predict(hits, 40) == analytic.predict(base, 40)
    with pytest.raises(ValueError):
        dataclasses.replace(base, hit_rate=1.5)


def test_taken_branches_take_the_link_off_their_rounds_and_nothing_fully_loaded() -> None:
    """Catches a taken rate that saves more than the link (the target still verifies), that is
    counted on top of the hit rate instead of within it, or that applies to a hub with no idle
    time (nothing is pre-drafted, so nothing is pushed)."""
    base = ModelInputs(0.7, 4, 0.010, 0.020, 0.004, 0.010)  # S 10 ms, verify 20, link 4
    hits = dataclasses.replace(base, hit_rate=0.5)
    taken = dataclasses.replace(base, hit_rate=0.5, taken_rate=0.25)
    assert math.isclose(
        analytic.predict(taken, 1).iteration_s, 0.5 * 0.010 + 0.020 + 0.75 * 0.004
    )  # (1 - h) S + verify + (1 - tau) link
    assert analytic.predict(taken, 1).iteration_s < analytic.predict(hits, 1).iteration_s
    full = analytic.saturation_point(base)
    assert analytic.predict(taken, full) == analytic.predict(base, full)
    with pytest.raises(ValueError):
        dataclasses.replace(base, hit_rate=0.2, taken_rate=0.3)


def test_a_cpu_drafter_takes_turns_with_the_message_path() -> None:
    """Where the drafter computes on the hub's CPU, a batch of B is served in S(B) + B c:
    catches the term left out (the CPU sweep's plan read 20% over at N = 128, batches of 64
    taking 36 ms against the profile's 29), charged per batch instead of per job, or charged
    to a drafter that does not share the processor (a GPU's, the emulated one)."""
    curve = _curve((1, 0.010), (64, 0.020))
    base = ModelInputs(0.7, 4, 0.010, 0.020, 0.001, 0.010, max_batch=64, curve=curve)
    apart = dataclasses.replace(base, per_message_s=0.0005)
    shared = dataclasses.replace(apart, messages_share_drafter=True)
    for b in (1, 8, 64):
        assert math.isclose(analytic.service_s(shared, b), analytic.service_s(apart, b) + b * 5e-4)
    assert analytic.service_s(apart, 64) == analytic.service_s(base, 64)
    full = analytic.predict(shared, 256)  # four full batches a cycle, nothing else
    assert full.regime == "fully-loaded"
    assert math.isclose(full.iteration_s, 4 * (analytic.service_s(base, 64) + 64 * 5e-4))


def test_a_batch_waits_for_its_jobs_to_arrive() -> None:
    """Catches a model that lets a batch of B start when its first job arrives, though the hub
    handles the B messages one after another (measured: 21-32% over-prediction at N = 8-32 on
    the emulated sweep without this term), or that charges it to the one-at-a-time hub."""
    curve = _curve((1, 0.010), (64, 0.020))
    base = ModelInputs(0.7, 4, 0.010, 0.020, 0.001, 0.010, max_batch=64, curve=curve)
    slow = dataclasses.replace(base, per_message_s=0.001)
    one = analytic.predict(slow, 1).iteration_s
    assert math.isclose(one, analytic.predict(base, 1).iteration_s)
    assert math.isclose(
        analytic.predict(slow, 32).iteration_s, analytic.predict(base, 32).iteration_s + 31 * 0.001
    )
    single = ModelInputs(0.7, 4, 0.010, 0.020, 0.001, 0.010, per_message_s=0.001)
    assert analytic.predict(single, 8) == analytic.predict(
        dataclasses.replace(single, per_message_s=0.0), 8
    )
