"""The two-hub scale sweep's and the S(B) script's pure parts: no timing is asserted."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from scripts.bench import harness, scale_report
from scripts.bench import run as bench
from scripts.bench import service as bench_service
from scripts.bench import targets as bench_targets
from scripts.emulate.report import service_curve
from starsd import analytic
from starsd import plan as planning
from starsd.profile import load_profile
from starsd.protocol import Stats, curve_arrays
from starsd.service import ServiceCurve

STATUS = """Name:\tpython
VmPeak:\t 1200000 kB
VmHWM:\t  420000 kB
VmRSS:\t  409600 kB
Threads:\t4
"""


def test_status_fields_parse_in_kb() -> None:
    """Catches: VmHWM or VmPeak read for VmRSS (prefix match), and a unit other than kB
    silently taken as kB."""
    assert harness.parse_status_kb(STATUS, "VmRSS") == 409600
    assert harness.parse_status_kb(STATUS, "VmHWM") == 420000
    with pytest.raises(KeyError):
        harness.parse_status_kb(STATUS, "VmSwap")
    with pytest.raises(ValueError):
        harness.parse_status_kb("VmRSS:\t 12 MB\n", "VmRSS")
    assert 1.0 < harness.rss_mb() < 1e6  # this process, in MiB


def test_sweep_alternates_which_hub_goes_first() -> None:
    order = [(n, h) for _, n, h in bench_common.sweep_order([1, 2, 4], scale_report.HUBS)]
    assert order == [
        (1, "one-at-a-time"),
        (1, "batched"),
        (2, "batched"),
        (2, "one-at-a-time"),
        (4, "one-at-a-time"),
        (4, "batched"),
    ]


def _stats(sizes: list[int], counts: list[int], seconds: list[float]) -> Stats:
    return Stats(
        0,
        1.0,
        0.5,
        sum(counts),
        sum(counts),
        0,
        0,
        0,
        0,
        0,
        0.0,
        **curve_arrays(list(zip(sizes, counts, seconds, strict=True))),
    )


def test_service_curve_from_per_size_counters() -> None:
    """Catches: cumulative counters taken as the window's (no subtraction), a size first seen
    inside the window dropped, spans not summed, and a size with no new batch reported."""
    spans = [
        (_stats([1, 4], [10, 2], [0.1, 0.05]), _stats([1, 4, 8], [12, 4, 1], [0.12, 0.1, 0.04])),
        (
            _stats([1, 4, 8], [12, 4, 1], [0.12, 0.1, 0.04]),
            _stats([1, 4, 8], [12, 6, 2], [0.12, 0.15, 0.08]),
        ),
    ]
    rows = service_curve(spans)
    assert rows == [
        {"batch": 1, "batches": 2, "service_ms": pytest.approx(10.0, rel=1e-5)},
        {"batch": 4, "batches": 4, "service_ms": pytest.approx(25.0, rel=1e-5)},
        {"batch": 8, "batches": 2, "service_ms": pytest.approx(40.0, rel=1e-5)},
    ]
    plain = Stats(0, 1.0, 0.5, 1, 1, 0, 0, 0, 0, 0, 0.0)  # a hub from before the curve
    assert service_curve([(plain, plain)]) is None


def test_curve_points_prefer_per_size_rows_then_the_mean_batch() -> None:
    """Catches: the fallback used although per-size rows exist, the mean batch size not
    rounded to a size, and seconds not scaled back from ms per batch to a total."""
    rows = [{"batch": 2, "batches": 5, "service_ms": 20.0}]
    assert scale_report.curve_points({"service_curve": rows}) == {2: (5, pytest.approx(0.1))}
    fallback = {
        "service_curve": None,
        "hub_batches": 10,
        "mean_batch_size": 3.6,
        "batch_service_ms": 30.0,
    }
    assert scale_report.curve_points(fallback) == {4: (10, pytest.approx(0.3))}
    assert (
        scale_report.curve_points(
            {"service_curve": None, "hub_batches": 0, "mean_batch_size": None}
        )
        == {}
    )


def test_pooled_points_weigh_by_batches() -> None:
    pooled = scale_report.pooled_points([{1: (3, 0.03)}, {1: (1, 0.05), 8: (2, 0.1)}])
    assert pooled == {1: pytest.approx(0.02), 8: pytest.approx(0.05)}


def _run(n: int, tokens: float, busy: float = 1.0, rss: float = 400.0) -> dict:
    return {
        "n_targets": n,
        "system_tokens_per_s": tokens,
        "hub_busy_fraction": busy,
        "hub_rss_peak_mb": rss,
    }


def test_hubs_compared_at_saturation_and_per_n() -> None:
    """Catches: the saturated figure taken below N_full or as the last run rather than the
    best, and per-N ratios that pair different N or divide the wrong way round."""
    one = [_run(1, 100), _run(2, 190), _run(4, 200), _run(8, 180)]
    batched = [_run(1, 100), _run(2, 250), _run(4, 600), _run(8, 1200)]
    out = scale_report.compare_hubs(one, batched, one_full=2, batched_full=8)
    assert out["saturated_tokens_per_s"] == {"one-at-a-time": 200, "batched": 1200}
    assert out["saturated_throughput_ratio"] == pytest.approx(6.0)
    assert out["throughput_ratio_by_n"] == {
        "1": 1.0,
        "2": pytest.approx(250 / 190),
        "4": 3.0,
        "8": pytest.approx(1200 / 180),
    }


def test_busy_from_n_full_and_the_rss_bound() -> None:
    """Catches: busy checked below N_full too (N = 1 idles by design), and the RSS bound taken
    against the first N, the largest RSS of any N, or in the wrong direction."""
    runs = [
        _run(1, 1, 0.4, 380.0),
        _run(2, 1, 0.97, 400.0),
        _run(4, 1, 0.96, 450.0),
        _run(8, 1, 0.99, 440.0),
    ]
    assert scale_report.busy_from(runs, 2) == {
        "min_busy_from_n_full": 0.96,
        "busy_from_n_full_ok": True,
    }
    assert scale_report.busy_from(runs, 1)["busy_from_n_full_ok"] is False
    ok = scale_report.rss_bound(runs, 480.0)  # peak N = 8 at 440 MiB: 1.09x
    assert ok["peak_n"] == 8 and ok["rss_at_peak_n_mb"] == 440.0
    assert ok["after_over_peak"] == pytest.approx(480 / 440) and ok["within_bound"] is True
    assert scale_report.rss_bound(runs, 490.0)["within_bound"] is False  # 1.11x
    assert scale_report.rss_bound(runs, 300.0)["within_bound"] is True  # freed: fine


def test_batched_inputs_carry_the_limit_and_the_curve() -> None:
    inputs = analytic.ModelInputs(0.7, 4, 0.005, 0.008, 0.001, 0.008)
    built = scale_report.batched_inputs(inputs, 64, [(8, 0.01), (1, 0.005)])
    assert built is not None and built.max_batch == 64 and built.curve is not None
    assert built.curve.at(1, 4) == pytest.approx(0.005)
    assert built.curve.at(8, 4) == pytest.approx(0.01)
    assert scale_report.batched_inputs(inputs, 64, []) is None


def test_service_rows_and_ratio_checks() -> None:
    """Catches: S(B)/S(1) against the mean rather than the median, a per-job time not divided
    by B, and a check that passes at the limit's wrong side."""
    times = {1: [0.010, 0.011, 0.030], 8: [0.016, 0.014, 0.015], 32: [0.026, 0.025, 0.024]}
    rows = bench_service.curve_rows(times)
    assert [r["batch"] for r in rows] == [1, 8, 32]
    assert rows[1]["median_ms"] == pytest.approx(15.0)
    assert rows[1]["ratio_to_1"] == pytest.approx(15 / 11)
    assert rows[2]["per_job_ms"] == pytest.approx(25.0 / 32)
    checks = bench_service.ratio_checks(rows)
    assert checks["s8_over_s1_ok"] is True  # 1.36 <= 1.5
    assert checks["s32_over_s1"] == pytest.approx(25 / 11) and checks["s32_over_s1_ok"] is True
    over = bench_service.ratio_checks(
        [{"batch": 1, "ratio_to_1": 1.0}, {"batch": 8, "ratio_to_1": 1.6}]
    )
    assert over["s8_over_s1_ok"] is False and over["s32_over_s1"] is None


def test_kv_memory_theory(tmp_path: Path) -> None:
    """2 layers x (K, V) x 4 heads x 32 dims x 4 B = 2 KiB per token: 100 MiB for 100 sessions
    of 512 tokens (the default draft's shape)."""
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_size": 128,
        "head_dim": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert bench_service.kv_mb_per_sessions(str(tmp_path), 100, 512) == pytest.approx(100.0)
    gpt2 = {"n_layer": 2, "n_head": 4, "n_embd": 128}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    assert bench_service.kv_mb_per_sessions(str(tmp_path), 100, 512) == pytest.approx(100.0)


def test_fake_sessions_drive_the_hub_proposer(llama_pair: tuple[Path, Path]) -> None:
    """Sessions advance with the verdicts a target sends: 2 accepted and 1 appended a round."""
    proposer, vocab = bench_service.load("llm", str(llama_pair[1]), str(llama_pair[0]))
    fake = bench_service.FakeSessions(proposer, vocab, gamma=4)
    times = bench_service.time_sizes(fake, (1, 2), repeats=2)
    assert {b: len(t) for b, t in times.items()} == {1: 2, 2: 2}
    held = fake.open(1, 8)
    assert len(held[0].state.tokens) == 8 and len(held[0].proposed) == 4
    fake.propose(held)
    assert len(held[0].state.tokens) == 8 + 2 + 1


def test_main_suite_pairs_batched_with_one_at_a_time() -> None:
    """Catches: the pair's order never alternating, the one-at-a-time run not at max-batch 1,
    and a target's time with concurrency 2 counted as if its sequences ran one after another."""
    cfg = bench.parse_args(["--quick"])
    plan = bench.batched_plan(cfg)
    assert [(r.mode, r.n, r.max_batch, r.concurrency) for r in plan] == [
        ("one-for-many-batched", 2, 64, 2),
        ("one-for-many-one-at-a-time", 2, 1, 2),
        ("one-for-many-one-at-a-time", 4, 1, 2),
        ("one-for-many-batched", 4, 64, 2),
    ]
    rows = [{"token_ids": [0] * 30, "stats": {"tokens_per_s": 10.0}}] * 2
    assert bench_targets.decode_seconds(rows, 2) == pytest.approx(3.0)
    runs = [
        {"mode": "one-for-many-batched", "n_targets": 2, "system_tokens_per_s": 300.0},
        {"mode": "one-for-many-one-at-a-time", "n_targets": 2, "system_tokens_per_s": 200.0},
        {"mode": "one-for-many", "n_targets": 2, "system_tokens_per_s": 1.0},
    ]
    assert bench.batched_comparison(runs) == {
        "2": {"batched": 300.0, "one_at_a_time": 200.0, "ratio": 1.5}
    }


def test_quick_scale_sweep_stops_at_128() -> None:
    assert bench.parse_args(["--suite", "scale", "--quick"]).scale_ns[-1] == 128
    assert bench.parse_args(["--suite", "scale"]).scale_ns[-1] == 256
    assert bench.parse_args(["--quick", "--scale-ns", "1", "256"]).scale_ns == (1, 256)


# -------------------------------------------------- gamma auto, pre-drafting

from scripts.bench import assisted as bench_assisted  # noqa: E402
from scripts.bench import common as bench_common  # noqa: E402
from scripts.bench import gamma as bench_gamma  # noqa: E402
from scripts.bench import predraft as bench_predraft  # noqa: E402


def test_gamma_order_rotates_every_mode_through_every_position() -> None:
    """Catches: a fixed order (auto always last, where the machine may be slowest), a mode or
    an N left out, and the rotation not moving by one per N."""
    order = bench_gamma.gamma_order([1, 8, 64])
    assert len(order) == 15 and {n for n, _ in order} == {1, 8, 64}
    firsts = [order[i * 5][1] for i in range(3)]
    assert firsts == [1, 2, 4]
    assert [m for n, m in order if n == 8] == [2, 4, 8, "auto", 1]
    assert all(
        sorted(map(str, (m for n, m in order if n == k))) == sorted(map(str, bench_gamma.MODES))
        for k in (1, 8, 64)
    )


def test_gamma_order_repeats_mirrored_and_reports_merge_by_median() -> None:
    """Catches repeats that run each mode's runs back to back (a drift would hit one mode's
    runs alike) or keep the same order every time (auto last each time); a merged report that
    takes one run (the last) or the mean (one disturbed run moves it) instead of the median;
    gamma counts not summed over the runs."""
    order = bench_gamma.gamma_order([8], repeats=3)
    once = [m for _, m in bench_gamma.gamma_order([8])]
    assert [m for _, m in order] == [*once, *once[::-1], *once]
    runs = [_report(8, t, {"4": c}) for t, c in ((500, 10), (900, 20), (600, 30))]
    merged = bench_gamma.merge_reports(runs)
    assert merged["system_tokens_per_s"] == 600 and merged["n_targets"] == 8
    assert merged["gamma_counts"] == {"4": 60} and merged["runs_tokens_per_s"] == [500, 900, 600]
    assert merged["latency_ms"] == runs[0]["latency_ms"]


def test_settle_rounds_ignores_probes_and_needs_a_tail() -> None:
    """Catches: the settled value taken from before the switch, probes (a round right after a
    span alone) counted as unsettled, an off-by-one from the switch round, and a verdict on a
    trace too short after the switch."""
    before = [6, 7, 6, 7, 6]
    after = [6, 5, 4, 3, 2, 1, 0, 3, 0, 1, 0, 1, 0, 1]  # the 3 after a 0 is a probe
    gammas = before + after
    assert bench_gamma.settle_rounds(gammas, len(before)) == 5  # from the first 1
    assert bench_gamma.settle_rounds([4] * 8, 2) == 0  # nothing to adapt
    assert bench_gamma.settle_rounds([8, 8, 2, 2], 2) is None  # too few rounds after
    assert bench_gamma.settle_rounds(gammas, None) is None  # no switch inside the trace
    # still moving at the end of the trace: not settled (not "settled at its last round")
    assert bench_gamma.settle_rounds([6, 6, 6, 5, 4, 3, 2], 2) is None
    # the tail's median is over choices: alternating spans and probes settle at 0
    assert bench_gamma.settle_rounds([7, 7, 7, 0, 7, 0, 6, 0, 7, 0], 2) == 1


def _report(n: int, tokens: float, gammas: dict[str, int] | None = None) -> dict:
    counts = gammas or {"4": 10}
    mean = sum(int(g) * c for g, c in counts.items()) / sum(counts.values())
    return {
        "n_targets": n,
        "system_tokens_per_s": tokens,
        "per_target_tokens_per_s": tokens / n,
        "hub_busy_fraction": 1.0,
        "acceptance_rate": 0.5,
        "mean_accepted": 2.0,
        "latency_ms": {"mean": 1.0, "p50": 1.0, "p99": 1.0, "std": 0.0},
        "bytes_per_round": 100.0,
        "queue_wait_ms": 1.0,
        "mean_gamma": mean,
        "gamma_counts": counts,
        "alone_tokens": 0,
        "verify_ms": 22.0,
    }


def test_gamma_comparison_picks_the_best_fixed_gamma_per_n() -> None:
    """Catches: auto compared with the mean or the last fixed gamma instead of the best, the
    ratio inverted, a miss at one N hidden by the others, and the model left out."""
    reports = {
        "gamma-fixed-1": [_report(1, 100), _report(8, 300)],
        "gamma-fixed-2": [_report(1, 120), _report(8, 400)],
        "gamma-fixed-4": [_report(1, 110), _report(8, 500)],
        "gamma-fixed-8": [_report(1, 90), _report(8, 450)],
        "gamma-auto": [_report(1, 118, {"2": 8, "0": 2}), _report(8, 460)],
    }
    inputs = analytic.ModelInputs(
        0.7,
        4,
        0.005,
        0.022,
        0.001,
        0.016,
        max_batch=64,
        curve=ServiceCurve.proportional(((1, 0.005), (8, 0.01)), 4),
    )
    out = bench_gamma.compare(reports, inputs)
    one, eight = out["by_n"]["1"], out["by_n"]["8"]
    assert one["best_fixed"] == 2 and one["auto_over_best_fixed"] == pytest.approx(118 / 120)
    assert eight["best_fixed"] == 4 and eight["auto_over_best_fixed"] == pytest.approx(0.92)
    assert one["ok"] is True and eight["ok"] is False and out["all_ok"] is False
    assert out["min_auto_over_best_fixed"] == pytest.approx(0.92)
    assert one["auto_alone_fraction"] == pytest.approx(0.2)
    assert set(one["model"]["fixed_tokens_per_s"]) == {"1", "2", "4", "8"}
    records = bench_gamma.records(reports, inputs)
    assert len(records) == 10 and {r["mode"] for r in records} == {
        "gamma-fixed-1",
        "gamma-fixed-2",
        "gamma-fixed-4",
        "gamma-fixed-8",
        "gamma-auto",
    }
    auto_one = next(r for r in records if r["mode"] == "gamma-auto" and r["n_targets"] == 1)
    assert auto_one["predicted_system_tokens_per_s"] == pytest.approx(
        analytic.auto_gamma(inputs, 1)[1].system_tokens_per_s
    )
    fixed_eight = next(r for r in records if r["mode"] == "gamma-fixed-8" and r["n_targets"] == 8)
    assert fixed_eight["predicted_system_tokens_per_s"] == pytest.approx(
        analytic.predict_at(inputs, 8, 8).system_tokens_per_s
    )
    # the comparison's own inputs: its fixed-4 runs' verify time, T_alone = auto_verify_ms
    own = bench_gamma.model_inputs(bench.parse_args([]), inputs, reports)
    assert own is not None and own.verify_s == pytest.approx(0.022)
    assert own.target_step_s == pytest.approx(0.016) and own.curve == inputs.curve


def test_gamma_comparison_models_the_target_profiles_costs_when_replaying() -> None:
    """Catches the comparison's model taking the CPU suite's emulated target (T_alone 16 ms,
    verify + 1.5 ms a draft token) while the emulated targets follow a target profile: under
    the H100 profile it then prices gamma 1's verify at a third of what the targets take."""
    target = "profiles/published-h100-llama31-8b-target.json"
    cfg = replace(bench.parse_args([]), target_profile=target)
    inputs = analytic.ModelInputs(0.7, 4, 0.005, 0.0064, 0.001, 0.016)
    own = bench_gamma.model_inputs(cfg, inputs, {})
    profile = load_profile(target, "target")
    assert own is not None
    assert own.target_step_s == pytest.approx(profile.seconds("step_ms")[(1, 0)])
    assert own.verify_per_token_s == pytest.approx(planning.verify_slope(profile))
    assert own.verify_per_token_s < 1e-4  # (the profile's V(1, g) is nearly flat)


def test_switch_summary_keeps_only_sessions_across_the_switch() -> None:
    trace = [
        {"target": 0, "gammas": [6] * 10 + [2, 1, 0, 1, 0, 1, 0, 1, 0], "switch_round": 10},
        {"target": 1, "gammas": [4, 4, 4], "switch_round": None},  # ended before the switch
        {"target": 2, "gammas": [1, 0, 1], "switch_round": 0},  # opened after it
        # alone (with probes) since before the switch, too few long spans after it to tell
        {"target": 3, "gammas": [6, 6, 0, 4, 0, 4, 0, 4, 0], "switch_round": 6},
    ]
    out = bench_gamma.switch_summary({"n_targets": 4, "gamma_trace": trace}, None)
    assert [s["target"] for s in out["sessions"]] == [0, 3]
    session, alone = out["sessions"]
    assert session["settle_rounds"] == 1 and session["gamma_before"] == 6
    assert session["unchanged"] is False
    assert alone["settle_rounds"] == 0 and alone["unchanged"] is True
    assert out["max_settle_rounds"] == 1 and out["all_within_limit"] is True
    moving = [{"target": 0, "gammas": [6] * 10 + [6, 5, 4, 3, 2], "switch_round": 10}]
    out = bench_gamma.switch_summary({"n_targets": 1, "gamma_trace": moving}, None)
    assert out["unsettled_sessions"] == 1 and out["all_within_limit"] is False


HUB_LOG = """\
2026-12-01 10:00:00 starsd.hub INFO target aa01/starsd-target connected (vocab 2048)
2026-12-01 10:00:01 starsd.hub INFO hub: targets=1 sessions=1 jobs=10 batches=9 mean_batch=1.11 \
S_ms=1:5.00 draft_busy=0.300 draft_ms_per_job=5.00 cpu_ms_per_job=4.00 messages=30 errors_sent=0 \
expired=0 dropped=0 unauthenticated=0 over_budget=0 predraft_s=0.50 replies_dropped=0
2026-12-01 10:00:01 starsd.hub INFO target aa01/starsd-target: sessions=1 rounds=9 \
mean_accepted=2.00 acceptance=0.500 gamma=4.00 gamma0=0.000 queue_wait_ms=0.40 \
predraft_hits=0.20 errors=0
2026-12-01 10:00:02 starsd.hub INFO target bb02/starsd-target connected (vocab 2048)
2026-12-01 10:00:02 starsd.hub INFO target aa01/starsd-target: sessions=1 rounds=30 \
mean_accepted=2.00 acceptance=0.500 gamma=4.00 gamma0=0.000 queue_wait_ms=1.00 \
predraft_hits=0.50 errors=0
2026-12-01 10:00:02 starsd.hub INFO target bb02/starsd-target: sessions=1 rounds=10 \
mean_accepted=1.00 acceptance=0.250 gamma=2.00 gamma0=0.500 queue_wait_ms=3.00 \
predraft_hits=0.10 errors=0
2026-12-01 10:00:02 starsd.hub INFO hub: targets=2 sessions=0 jobs=50 batches=40 mean_batch=1.25 \
S_ms=1:5.00 draft_busy=0.300 draft_ms_per_job=5.00 cpu_ms_per_job=4.00 messages=90 errors_sent=0 \
expired=0 dropped=0 unauthenticated=0 over_budget=0 predraft_s=1.25 replies_dropped=0
"""


def test_hub_log_gives_each_targets_last_figures() -> None:
    """Catches: the first stats line of a target taken instead of its last, targets mixed up,
    the pooled figures weighted equally instead of by rounds (alone rounds included), and the
    hub line's predraft_s read from an earlier line."""
    lines = bench_common.target_lines(HUB_LOG)
    assert lines["aa01/starsd-target"]["predraft_hits"] == 0.5
    assert lines["aa01/starsd-target"]["rounds"] == 30
    assert lines["bb02/starsd-target"]["queue_wait_ms"] == 3.0
    assert bench_common.connected_targets(HUB_LOG) == ["aa01/starsd-target", "bb02/starsd-target"]
    assert bench_common.hub_line(HUB_LOG)["predraft_s"] == 1.25
    pooled = bench_common.pooled_targets(lines, bench_common.connected_targets(HUB_LOG))
    # weights: 30 rounds; 10 rounds + 10 alone (gamma0 0.5) = 20
    assert pooled["hit_rate"] == pytest.approx((0.5 * 30 + 0.1 * 20) / 50)
    assert pooled["queue_wait_ms"] == pytest.approx((1.0 * 30 + 3.0 * 20) / 50)
    assert pooled["targets"] == 2 and pooled["rounds"] == 40
    only = bench_common.pooled_targets(lines, ["bb02/starsd-target", "gone/x"])
    assert only["targets"] == 1 and only["hit_rate"] == pytest.approx(0.1)


def test_paired_rotation_and_summary() -> None:
    """Catches: one fixed order across repetitions, means instead of medians, ratios inverted
    or taken against the wrong base, and identity checked on a mode without ids."""
    order = bench_assisted.rotation(bench_assisted.MODES, 3)
    assert [o[0] for o in order] == ["hf-assisted", "centralized", "hub-defaults"]
    assert all(sorted(o) == sorted(bench_assisted.MODES) for o in order)
    ids = [[1, 2], [3]]
    results = {
        "hf-assisted": [{"tokens_per_s": x, "token_ids": ids} for x in (80, 90, 200)],
        "centralized": [{"tokens_per_s": x, "mean_accepted": 3.0} for x in (100, 100, 100)],
        "hub-defaults": [
            {"tokens_per_s": x, "token_ids": ids, "mean_accepted": 2.5} for x in (99, 101, 1)
        ],
        "hub-gamma4-no-predraft": [
            {"tokens_per_s": 95.0, "token_ids": [[1, 2], [4]], "mean_accepted": 2.8}
        ]
        * 3,
    }
    out = bench_assisted.summary(results, order, ids, {})
    assert out["median_tokens_per_s"]["hf-assisted"] == 90
    assert out["ratios"]["hub_defaults_over_hf"] == pytest.approx(99 / 90)
    assert out["ratios"]["hub_defaults_over_centralized"] == pytest.approx(0.99)
    assert out["met"] == {"hub_over_hf": True, "hub_over_centralized": True}
    assert out["identical_to_target_alone"] == {
        "hf-assisted": True,
        "hub-defaults": True,
        "hub-gamma4-no-predraft": False,
    }
    assert out["ratios_per_rep"]["hub_defaults_over_hf"][2] == pytest.approx(1 / 200)
    # the defaults against pre-drafting alone (gamma 4): auto's effect with pre-drafting on
    results["hub-gamma4-predraft"] = [{"tokens_per_s": 110.0, "token_ids": ids}] * 3
    effects = bench_assisted.summary(results, order, ids, {})["feature_effects"]
    assert effects == {
        "auto_with_predraft": pytest.approx(99 / 110),
        "predraft_at_gamma4": pytest.approx(110 / 95),
    }


def test_predraft_cases_alternate_and_compare_against_one_step() -> None:
    """Catches: the same hub always first, the added wait taken the wrong way round, and a case
    passing with an added wait above one step."""
    plan = bench_predraft.cases()
    assert len(plan) == 6 and [p[2][0] for p in plan] == ["predraft", "no-predraft"] * 3
    assert {(n, t) for n, t, _ in plan} == {(n, t) for n in (1, 2, 4) for t in (0.0, 0.8)}
    twice = bench_predraft.cases(reps=2)  # A B B A within a case, and from case to case
    assert [p[2][0] for p in twice[:4]] == ["predraft", "no-predraft", "no-predraft", "predraft"]
    assert [(n, t) for n, t, _ in twice[:4]] == [(1, 0.0), (1, 0.0), (2, 0.0), (2, 0.0)]

    def row(hub: str, n: int, wait: float, rate: float) -> dict:
        return {
            "n_targets": n,
            "temperature": 0.0,
            "hub": hub,
            "system_tokens_per_s": rate,
            "hit_rate": 0.4 if hub == "predraft" else 0.0,
            "queue_wait_ms": wait,
            "mean_gamma": 4.0,
            "mean_accepted": 2.0,
        }

    rows = [
        row("predraft", 1, 1.5, 120.0),
        row("no-predraft", 1, 0.5, 100.0),
        row("predraft", 2, 3.0, 150.0),
        row("no-predraft", 2, 0.5, 150.0),
        row("predraft", 1, 1.3, 80.0),
        row("predraft", 1, 9.0, 130.0),
    ]  # medians: 1.5, 120
    steps = {"1": {"max_ms": 1.2}, "2": {"max_ms": 2.0}}
    inputs = analytic.ModelInputs(0.7, 4, 0.005, 0.01, 0.001, 0.02)
    out = bench_predraft.summary(rows, steps, inputs)
    one, two = out["cases"]["1/0.0"], out["cases"]["2/0.0"]
    assert one["added_wait_ms"] == pytest.approx(1.0) and one["within_one_step"] is True
    assert two["added_wait_ms"] == pytest.approx(2.5) and two["within_one_step"] is False
    assert one["throughput_ratio"] == pytest.approx(1.2) and out["all_within_one_step"] is False
    assert one["predicted_ratio"] > 1.0  # under-loaded: hits shorten the round
    assert one["predraft"]["runs"] == 3 and one["predraft"]["system_tokens_per_s_each"] == [
        120.0,
        80.0,
        130.0,
    ]
    emulated = bench_predraft.emulated_summary(
        [
            {
                "n_targets": 1,
                "hub": "predraft",
                "queue_wait_ms": 1.0,
                "proposal_wait_ms": {"p50": 5.0, "p99": 9.0},
            },
            {
                "n_targets": 1,
                "hub": "no-predraft",
                "queue_wait_ms": 0.1,
                "proposal_wait_ms": {"p50": 4.0, "p99": 6.0},
            },
        ],
        steps,
    )
    case = emulated["by_n"]["1"]
    assert case["added_queue_wait_ms"] == pytest.approx(0.9) and case["within_one_step"]
    assert case["added_proposal_wait_p99_ms"] == pytest.approx(3.0)


def test_predraft_steps_time_every_step(llama_pair: tuple[Path, Path]) -> None:
    from starsd import models

    draft = models.load_causal_lm(llama_pair[1])
    times = bench_predraft.predraft_steps(draft, 2, gamma=3, repeats=2)
    assert len(times) >= 2 * 2 and all(t > 0 for t in times)  # a probe and a branch batch
