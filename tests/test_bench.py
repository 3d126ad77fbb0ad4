"""A small emulated run against an in-process hub, checked against the benchmark JSON contract."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import RunningHub

from edge.emulated import EmulationConfig, accepted_count, emulate
from starsd import analytic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench

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


async def test_emulated_run_fills_the_json_contract(
    running_hub: RunningHub, llama_pair: tuple[Path, Path]
) -> None:
    cfg = EmulationConfig(hub=running_hub.endpoint, targets=3, alpha=0.6, verify_ms=2.0,
                          duration=0.6, warmup=0.2, model=str(llama_pair[0]))  # fmt: skip
    report = await emulate(cfg)
    assert report["rounds"] > 0 and report["system_tokens_per_s"] > 0
    assert 0.0 < report["hub_busy_fraction"] <= 1.0
    assert set(report["latency_ms"]) == {"mean", "p50", "p99", "std"}
    inputs = analytic.ModelInputs(0.6, 4, report["draft_service_s"], 0.002, 0.0002, 0.002)
    record = bench.run_record(
        "emulated", 3, **{k: report[k] for k in bench._EMULATED_KEYS},
        predicted_system_tokens_per_s=bench.emulated_prediction(inputs, report),
    )  # fmt: skip
    assert set(record) >= CONTRACT
    assert all(record[k] is not None for k in CONTRACT)
    assert record["mode"] == "emulated" and record["n_targets"] == 3
    summary = bench.saturation([record], inputs)
    assert summary["n_full_measured"] == 3 and summary["n_full_model"] >= 1
    single = {**record, "n_targets": 1}
    steadiness = bench.latency_steadiness([single], record, summary["n_full_model"])
    assert steadiness["single_pair"] == steadiness["at_n_full"] == record["latency_ms"]["std"]
    assert steadiness["one_to_one_same_machine"] == record["latency_ms"]["std"]
    assert len(report["token_latency_ms"]) == report["tokens_in_window"]

