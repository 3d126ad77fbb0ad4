"""scripts.bench.run_report: the main and lan suites' table and plot."""

from __future__ import annotations

from pathlib import Path

from scripts.bench import run_report


def _run(mode: str, n: int, rate: float, kind: str | None = None) -> dict:
    record = {
        "mode": mode,
        "n_targets": n,
        "system_tokens_per_s": rate,
        "per_target_tokens_per_s": rate / n,
        "predicted_system_tokens_per_s": None if mode == "standalone" else 1.1 * rate,
        "hub_busy_fraction": None,
        "mean_accepted": 2.5,
        "latency_ms": {"mean": 4.0, "p50": 3.9, "p99": 6.0, "std": 0.5},
    }
    return record | ({"draft_kind": kind} if kind else {})


def test_the_report_labels_each_run_and_plots_both_panels(tmp_path: Path) -> None:
    """Catches a report that cannot be drawn (a name shadowed inside the plot) or that labels
    an EAGLE run as the draft LLM's."""
    result = {
        "suite": "main",
        "runs": [_run("standalone", 1, 250.0), _run("one-for-many", 2, 400.0, "eagle")],
        "batched_vs_one_at_a_time": {"2": {"batched": 534.0, "one_at_a_time": 512.0}},
    }
    table = run_report.markdown(result)
    assert "| one-for-many (eagle) | 2 | 400.0 | 440.0 |" in table
    assert "| standalone | 1 | 250.0 | - |" in table
    run_report.plot(result, tmp_path / "bench.png", concurrency=2)
    assert (tmp_path / "bench.png").stat().st_size > 0
