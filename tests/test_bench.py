"""A small emulated run against an in-process hub, checked against the benchmark JSON contract."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import RunningHub

from starsd import analytic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_scale
from emulated import EmulationConfig, Phases, accepted_count, emulate, schedule

CONTRACT = {"mode", "n_targets", "system_tokens_per_s", "per_target_tokens_per_s",
            "predicted_system_tokens_per_s", "hub_busy_fraction", "acceptance_rate",
            "mean_accepted", "latency_ms", "bytes_per_round"}  # fmt: skip


def test_accepted_count_follows_alpha() -> None:
    import random

    rng = random.Random(0)
    draws = [accepted_count(rng, 0.5, 4) for _ in range(20_000)]
    mean = sum(draws) / len(draws)
    assert abs(mean - (analytic.expected_tokens_per_round(0.5, 4) - 1)) < 0.03
    assert max(draws) == 4 and min(draws) == 0


def test_calibration_slices_alternate_with_the_window() -> None:
    cfg = EmulationConfig(hub="", duration=2.0, calibration=1.0, slices=4)
    phases = Phases(bounds=schedule(10.0, cfg))
    assert len(phases.bounds) == 2 * 4 + 2 and phases.finish == pytest.approx(13.0)
    middles = [(a + b) / 2 for a, b in zip(phases.bounds, phases.bounds[1:], strict=False)]
    kinds = [phases.kind(t) for t in middles]
    assert kinds == ["calibration", "window"] * 4 + ["calibration"]
    window = sum(b - a for a, b, k in zip(phases.bounds, phases.bounds[1:], kinds, strict=False)
                 if k == "window")  # fmt: skip
    assert window == pytest.approx(2.0)
    assert phases.kind(9.9) is None and phases.kind(13.1) is None  # warm-up, after the end
    assert Phases().kind(10.0) is None  # nothing counts before the schedule is set


async def test_emulated_run_fills_the_json_contract(
    running_hub: RunningHub, llama_pair: tuple[Path, Path]
) -> None:
    cfg = EmulationConfig(hub=running_hub.endpoint, targets=3, alpha=0.6, verify_ms=2.0,
                          duration=0.6, warmup=0.2, calibration=0.3,
                          model=str(llama_pair[0]))  # fmt: skip
    report = await emulate(cfg)
    assert report["rounds"] > 0 and report["system_tokens_per_s"] > 0
    assert 0.0 < report["hub_busy_fraction"] <= 1.0
    assert set(report["latency_ms"]) == {"mean", "p50", "p99", "std"}
    calibration = report["calibration"]  # the slices alternating with the window's
    assert calibration["jobs"] > 0 and calibration["draft_service_s"] > 0
    assert calibration["verify_ms"] > 0
    inputs = analytic.ModelInputs(0.6, 4, report["draft_service_s"], 0.002, 0.0002, 0.002)
    record = bench_scale.emulated_record(inputs, report)
    alpha = analytic.alpha_from_mean_accepted(report["mean_accepted"], 4)
    calibrated = replace(inputs, alpha=alpha, draft_s=calibration["draft_service_s"],
                         verify_s=calibration["verify_ms"] / 1e3)  # fmt: skip
    assert record["predicted_system_tokens_per_s"] == pytest.approx(
        analytic.predict(calibrated, 3).system_tokens_per_s)
    assert set(record) >= CONTRACT
    assert all(record[k] is not None for k in CONTRACT)
    assert record["mode"] == "emulated" and record["n_targets"] == 3
    summary = bench_scale.saturation([record], inputs)
    assert summary["n_full_measured"] == 3 and summary["n_full_model"] >= 1
    single = {**record, "n_targets": 1}
    steadiness = bench_scale.latency_steadiness([single], record, summary["n_full_model"])
    assert steadiness["single_pair"] == steadiness["at_n_full"] == record["latency_ms"]["std"]
    assert steadiness["one_to_one_same_machine"] == record["latency_ms"]["std"]
    assert len(report["token_latency_ms"]) == report["tokens_in_window"]

