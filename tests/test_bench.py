"""A small emulated run against an in-process hub, checked against the benchmark JSON contract."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import RunningHub, serving_hub

from scripts.bench import hub_flood, scale_report
from scripts.emulate.acceptance import accepted_count
from scripts.emulate.config import EmulationConfig, Phases, schedule
from scripts.emulate.emulated import emulate
from starsd import analytic

CONTRACT = {
    "mode",
    "n_targets",
    "system_tokens_per_s",
    "per_target_tokens_per_s",
    "predicted_system_tokens_per_s",
    "hub_busy_fraction",
    "acceptance_rate",
    "mean_accepted",
    "latency_ms",
    "bytes_per_round",
}


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_accepted_count_follows_alpha(alpha: float) -> None:
    """Catches a wrong acceptance law: Binomial instead of stop-at-first-rejection, a cap
    other than gamma, and (at 0.8: 0.5 cannot tell) accepting with probability 1 - alpha."""
    import random

    rng = random.Random(0)
    draws = [accepted_count(rng, alpha, 4) for _ in range(20_000)]
    mean = sum(draws) / len(draws)  # standard error < 0.012 at either alpha
    assert abs(mean - (analytic.expected_tokens_per_round(alpha, 4) - 1)) < 0.03
    assert max(draws) == 4 and min(draws) == 0


def test_calibration_slices_alternate_with_the_window() -> None:
    cfg = EmulationConfig(hub="", duration=2.0, calibration=1.0, slices=4)
    phases = Phases(bounds=schedule(10.0, cfg))
    assert len(phases.bounds) == 2 * 4 + 2 and phases.finish == pytest.approx(13.0)
    middles = [(a + b) / 2 for a, b in zip(phases.bounds, phases.bounds[1:], strict=False)]
    kinds = [phases.kind(t) for t in middles]
    assert kinds == ["calibration", "window"] * 4 + ["calibration"]
    window = sum(
        b - a
        for a, b, k in zip(phases.bounds, phases.bounds[1:], kinds, strict=False)
        if k == "window"
    )
    assert window == pytest.approx(2.0)
    assert phases.kind(9.9) is None and phases.kind(13.1) is None  # warm-up, after the end
    assert Phases().kind(10.0) is None  # nothing counts before the schedule is set


async def test_emulated_run_fills_the_json_contract(
    running_hub: RunningHub, llama_pair: tuple[Path, Path]
) -> None:
    cfg = EmulationConfig(
        hub=running_hub.endpoint,
        targets=3,
        alpha=0.6,
        verify_ms=2.0,
        duration=0.6,
        warmup=0.2,
        calibration=0.3,
        model=str(llama_pair[0]),
    )
    report = await emulate(cfg)
    assert report["rounds"] > 0 and report["system_tokens_per_s"] > 0
    assert 0.0 < report["hub_busy_fraction"] <= 1.0
    assert set(report["latency_ms"]) == {"mean", "p50", "p99", "std"}
    calibration = report["calibration"]  # the slices alternating with the window's
    assert calibration["jobs"] > 0 and calibration["draft_service_s"] > 0
    assert calibration["verify_ms"] > 0
    inputs = analytic.ModelInputs(0.6, 4, report["draft_service_s"], 0.002, 0.0002, 0.002)
    record = scale_report.emulated_record(inputs, report, scale_report.ONE_AT_A_TIME)
    alpha = analytic.alpha_from_mean_accepted(report["mean_accepted"], 4)
    calibrated = replace(
        inputs,
        alpha=alpha,
        draft_s=calibration["draft_service_s"],
        verify_s=calibration["verify_ms"] / 1e3,
    )
    assert record["predicted_system_tokens_per_s"] == pytest.approx(
        analytic.predict(calibrated, 3).system_tokens_per_s
    )
    assert set(record) >= CONTRACT
    assert all(record[k] is not None for k in CONTRACT)
    assert record["mode"] == "emulated-one-at-a-time" and record["n_targets"] == 3
    assert record["prediction_model"] == "per-job S(d)"
    assert len(report["token_latency_ms"]) == report["tokens_in_window"]
    # what the two-hub sweep adds: batches, the rounds' wait for a proposal, the emulator's load
    assert report["hub_batches"] > 0 and report["mean_batch_size"] >= 1.0
    assert report["proposal_wait_ms"]["p99"] >= report["proposal_wait_ms"]["p50"] > 0
    assert 0.0 < report["emulator_cpu_fraction"] < 1.5
    assert calibration["hub_batches"] > 0 and calibration["batch_service_ms"] > 0
    # the hub's S(B) counters: every batch of the window in exactly one size's row
    assert sum(row["batches"] for row in report["service_curve"]) == report["hub_batches"]
    assert set(record) >= {
        "max_batch",
        "mean_batch_size",
        "proposal_wait_ms",
        "service_curve",
        "hub_rss_peak_mb",
        "hub_rss_after_mb",
        "emulator_cpu_fraction",
    }


# S(d) = 2 ms, R = 5 ms verify + 1.5 ms link: (S + R) / S = 4.25, so the model's N_full is 5.
# Rounding down or to nearest, or leaving out S(d) or the link, gives 4.
SWEEP_INPUTS = analytic.ModelInputs(0.7, 4, 0.002, 0.005, 0.0015, 0.008)


def _run(
    n: int, busy: float, system: float, predicted: float, one_s: float, std: float, mean: float
) -> dict:
    return {
        "n_targets": n,
        "hub_busy_fraction": busy,
        "system_tokens_per_s": system,
        "predicted_system_tokens_per_s": predicted,
        "predicted_one_s_tokens_per_s": one_s,
        "latency_ms": {"std": std, "mean": mean},
    }


# A sweep whose answers are known and differ from the trivial ones. Busy reaches 0.95 exactly
# at N = 8 (0.949 at N = 4); prediction errors are +5%, -5%, +5%, 0, -20%, +10% (the largest
# is below the prediction) and, for the one-S(d) prediction, 30% at N = 2.
SWEEP = [
    _run(1, 0.25, 105.0, 100.0, 100.0, 1.0, 10.0),
    _run(2, 0.50, 190.0, 200.0, 190.0 / 1.3, 2.0, 10.0),
    _run(4, 0.949, 420.0, 400.0, 400.0, 3.0, 12.0),
    _run(8, 0.95, 400.0, 400.0, 400.0, 4.0, 16.0),
    _run(16, 0.99, 400.0, 500.0, 400.0, 5.0, 20.0),
    _run(32, 1.0, 440.0, 400.0, 400.0, 6.0, 24.0),
]


def test_saturation_on_a_known_sweep() -> None:
    """Catches: the measured N_full read off the wrong step (the first or last run, > 0.95
    instead of >= 0.95, a lower threshold), the model's N_full rounded the wrong way or missing
    a term, "within one step" compared in N instead of in sweep steps, and a max prediction
    error that drops the abs(), takes another run than the worst, or the other prediction."""
    summary = scale_report.saturation(SWEEP, SWEEP_INPUTS)
    assert summary["n_full_measured"] == 8
    assert summary["n_full_model"] == 5
    # the same step: N = 8 is the first swept N >= 5 (in N they are 3 apart, not 1)
    assert summary["n_full_within_one_step"] is True
    assert summary["max_prediction_error"] == pytest.approx(0.2)
    assert summary["max_prediction_error_one_s"] == pytest.approx(0.3)


def test_saturation_when_the_hub_never_fills_or_fills_far_from_the_model() -> None:
    """Catches: a sweep that never reaches busy 0.95 reported as saturating somewhere inside
    it (its last N is the only honest answer), and a one-step check that always says yes."""
    never = [{**r, "hub_busy_fraction": min(r["hub_busy_fraction"], 0.9)} for r in SWEEP]
    assert scale_report.saturation(never, SWEEP_INPUTS)["n_full_measured"] == 32
    late = [{**r, "hub_busy_fraction": 1.0 if r["n_targets"] == 32 else 0.5} for r in SWEEP]
    summary = scale_report.saturation(late, SWEEP_INPUTS)
    assert summary["n_full_measured"] == 32  # two steps past the model's (8)
    assert summary["n_full_within_one_step"] is False


def test_latency_steadiness_picks_the_runs_it_names() -> None:
    """Catches: the N = 1 run, the run nearest N_full (N = 4 for N_full = 5, not the first
    N >= 5) or the 1:1 record mixed up, and a coefficient of variation not std / mean of the
    same record."""
    one_to_one = {"n_targets": 5, "latency_ms": {"std": 7.0, "mean": 35.0}}
    steadiness = scale_report.latency_steadiness(SWEEP, one_to_one, 5)
    assert steadiness == {
        "single_pair": 1.0,
        "at_n_full": 3.0,
        "n_full_run": 4,
        "one_to_one_same_machine": 7.0,
        "cv_at_n_full": pytest.approx(0.25),
        "cv_one_to_one_same_machine": pytest.approx(0.2),
    }


def test_verify_time_alone_step_and_the_switch() -> None:
    """Catches: the per-token verify cost left out or applied to gamma + 1, an alone step that
    ignores its option, and alpha switching before its time or without --alpha-switch."""
    from scripts.emulate.config import switch_time

    cfg = EmulationConfig(
        hub="",
        verify_ms=16.0,
        verify_ms_per_token=1.5,
        alone_step_ms=0.0,
        alpha=0.9,
        alpha_switch=0.3,
        switch_at=0.25,
    )
    assert cfg.verify_s(4) == pytest.approx(0.022) and cfg.verify_s(1) == pytest.approx(0.0175)
    assert cfg.step_alone_s == pytest.approx(0.016)  # 0: the verify time of no draft token
    assert replace(cfg, alone_step_ms=9.0).step_alone_s == pytest.approx(0.009)
    phases = Phases(bounds=[10.0, 11.0, 14.0])
    phases.switch = switch_time(phases.bounds, cfg)
    assert phases.switch == pytest.approx(11.0) and cfg.tracing
    assert phases.alpha(cfg, 10.9) == 0.9 and phases.alpha(cfg, 11.0) == 0.3
    plain = replace(cfg, alpha_switch=None)
    assert switch_time(phases.bounds, plain) == float("inf") and not plain.tracing
    assert Phases().alpha(plain, 1e9) == 0.9


async def test_emulated_targets_honour_spans_alone(
    llama_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """gamma 0 under a hub that always says alone (--gamma 0): every round is a span decoded
    alone, counted as tokens (not as verified rounds), and the hub drafts nothing."""
    from starsd import hub as hub_module

    config = hub_module.HubConfig(
        model=str(llama_pair[1]), bind="tcp://127.0.0.1:*", stats_interval=3600, gamma=0
    )
    async with serving_hub(config) as running:
        cfg = EmulationConfig(
            hub=running.endpoint,
            targets=2,
            gamma=0,
            verify_ms=2.0,
            alone_step_ms=0.2,
            duration=0.6,
            warmup=0.2,
            calibration=0.3,
            model=str(llama_pair[0]),
            trace_gamma=True,
        )
        report = await emulate(cfg)
    assert report["rounds"] == 0 and report["alone_spans"] > 0
    assert set(report["gamma_counts"]) == {"0"} and report["mean_gamma"] == 0.0
    assert report["alone_tokens"] == report["tokens_in_window"] > report["alone_spans"]
    assert report["sequence_errors"] == 0
    assert report["gamma_trace"] and all(set(t["gammas"]) <= {0} for t in report["gamma_trace"])


async def test_emulated_auto_gamma_and_switch_trace(
    running_hub: RunningHub, llama_pair: tuple[Path, Path]
) -> None:
    """gamma 0 on a --gamma auto hub: proposals of the hub's choosing (any length, spans alone
    allowed), acceptance counted against the tokens proposed, and a trace per session that
    marks where the switch fell."""
    cfg = EmulationConfig(
        hub=running_hub.endpoint,
        targets=2,
        gamma=0,
        alpha=0.9,
        verify_ms=2.0,
        verify_ms_per_token=0.2,
        duration=0.8,
        warmup=0.2,
        calibration=0.4,
        model=str(llama_pair[0]),
        alpha_switch=0.3,
        switch_at=0.5,
    )
    report = await emulate(cfg)
    counts = report["gamma_counts"]
    assert sum(counts.values()) == report["rounds"] + report["alone_spans"] > 0
    assert 0.0 <= report["acceptance_rate"] <= 1.0
    traces = report["gamma_trace"]
    assert {t["target"] for t in traces} == {0, 1}
    crossed = [t for t in traces if t["switch_round"] is not None]
    assert crossed and all(0 <= t["switch_round"] <= len(t["gammas"]) for t in crossed)


def test_hub_flood_splits_python_from_zeromq_threads() -> None:
    """Catches ZeroMQ's I/O threads counted as the hub's serial (GIL) cost, or a thread that
    appeared between the two readings left out."""
    before = {"python:1": 1.0, "ZMQbg/IO/0:3": 0.5}
    after = {"python:1": 1.25, "python:2": 0.125, "ZMQbg/IO/0:3": 0.75, "ZMQbg/Reaper:4": 0.0}
    assert hub_flood.python_cpu_s(before, after) == (0.375, 0.25)


@pytest.mark.slow
def test_hub_flood_measures_a_null_hub(tmp_path: Path) -> None:
    """Catches a flood that stalls (a DRAFT with a stale seq is refused, not answered) or reads
    another process's CPU: every session count completes rounds and the hub spent CPU on them."""
    out = tmp_path / "flood.json"
    assert hub_flood.main(["--sessions", "1,4", "--seconds", "0.5", "--out", str(out)]) == 0
    floods = json.loads(out.read_text())["floods"]
    assert [f["sessions"] for f in floods] == [1, 4]
    assert all(f["rounds_per_s"] > 50 and f["hub_python_cpu_ms_per_round"] > 0 for f in floods)
