"""The scale suite's figures: each run against the analytic model, each hub's summary (N_full,
saturation, busy, RSS), the two hubs compared, and the report (markdown, plot). Pure: what
``scripts.bench.scale`` measured goes in, numbers come out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from scripts.bench import gamma as bench_gamma
from scripts.bench import trees as bench_trees
from scripts.bench.common import BenchConfig, run_record
from starsd import analytic
from starsd.service import ServiceCurve

# The two hubs compared, by record mode; "batched" runs with cfg.max_batch.
ONE_AT_A_TIME, BATCHED = "one-at-a-time", "batched"
HUBS = (ONE_AT_A_TIME, BATCHED)
BUSY_FULL = 0.95  # the model's fully-loaded regime, as measured: the hub no longer idles
RSS_BOUND = 0.10  # RSS after the sweep (sessions closed) at most 10% above the peak N's

# ---------------------------------------------------------------------- the model


def batched_inputs(
    inputs: analytic.ModelInputs, max_batch: int, points: Iterable[tuple[int, float]]
) -> analytic.ModelInputs | None:
    """The model's inputs for a hub that drafts up to ``max_batch`` jobs in one batch, whose
    service time per batch is S(B) at ``points`` (batch size, seconds); None without points."""
    pts = tuple(sorted(points))
    if not pts:
        return None
    curve = ServiceCurve.proportional(pts, inputs.gamma)
    return replace(inputs, max_batch=max_batch, curve=curve)


def curve_points(calibration: dict) -> dict[int, tuple[int, float]]:
    """S(B) observations from one step's calibration slices: batch size -> (batches, seconds).

    Per-size counters when the hub's STATS carry them; otherwise the step's mean batch size
    (rounded) and its mean service per batch."""
    rows = calibration.get("service_curve")
    if rows:
        return {r["batch"]: (r["batches"], r["batches"] * r["service_ms"] / 1e3) for r in rows}
    batches, mean_b = calibration.get("hub_batches"), calibration.get("mean_batch_size")
    if not batches or mean_b is None or calibration.get("batch_service_ms") is None:
        return {}
    return {max(1, round(mean_b)): (int(batches), batches * calibration["batch_service_ms"] / 1e3)}


def pooled_points(observations: Iterable[dict[int, tuple[int, float]]]) -> dict[int, float]:
    """Mean S(B) per batch size over several steps' observations (weighted by batches)."""
    totals: dict[int, list[float]] = {}
    for obs in observations:
        for b, (count, seconds) in obs.items():
            row = totals.setdefault(b, [0, 0.0])
            row[0] += count
            row[1] += seconds
    return {b: s / c for b, (c, s) in totals.items() if c}


def sweep_inputs(cfg: BenchConfig, reports: list[dict], link_ms: float) -> analytic.ModelInputs:
    """One hub's sweep-wide per-job model inputs: S(d) = busy / jobs over every window."""
    draft_s = sum(r["hub_busy_s"] for r in reports) / sum(r["hub_jobs"] for r in reports)
    verify_s = sum(r["verify_ms"] for r in reports) / len(reports) / 1e3
    return analytic.ModelInputs(
        cfg.alpha, cfg.gamma, draft_s, verify_s, link_ms / 1e3, cfg.verify_ms / 1e3
    )


def emulated_record(
    inputs: analytic.ModelInputs,
    report: dict,
    hub: str = BATCHED,
    curve: dict[int, float] | None = None,
) -> dict:
    """One sweep step's record: what the window measured, and the model's prediction of it.

    ``curve`` (the sweep's S(B) from its calibration slices, batched hub): the prediction is
    the model with S(B), this step's own calibration points taking precedence, and the "one S"
    prediction the sweep's curve alone; without a curve, the per-job model calibrated on this
    step (and the sweep's one S(d)).
    """
    calibration = report["calibration"]
    per_job = emulated_prediction(inputs, report, calibrated=True)
    one_s = emulated_prediction(inputs, report, calibrated=False)
    with_curve = None
    if curve:
        own = {b: s / c for b, (c, s) in curve_points(calibration).items() if c}
        with_curve = curve_prediction(inputs, report, {**curve, **own})
        one_s = curve_prediction(inputs, report, curve) or one_s  # the sweep's one S(B)
    return run_record(
        f"emulated-{hub}",
        report["n_targets"],
        **{k: report[k] for k in _EMULATED_KEYS},
        max_batch=report.get("max_batch", 1),
        mean_batch_size=report.get("mean_batch_size"),
        batch_service_ms=report.get("batch_service_ms"),
        service_curve=report.get("service_curve"),
        calibrated_mean_batch_size=calibration.get("mean_batch_size"),
        proposal_wait_ms=report.get("proposal_wait_ms"),
        emulator_cpu_fraction=report.get("emulator_cpu_fraction"),
        load_generator_ms_per_round=report.get("load_generator_ms_per_round"),
        hub_rss_peak_mb=report.get("hub_rss_peak_mb"),
        hub_rss_after_mb=report.get("hub_rss_after_mb"),
        draft_service_ms=1e3 * report["draft_service_s"],
        verify_ms=report["verify_ms"],
        calibrated_draft_service_ms=None
        if calibration["draft_service_s"] is None
        else 1e3 * calibration["draft_service_s"],
        predicted_system_tokens_per_s=per_job if with_curve is None else with_curve,
        prediction_model="per-job S(d)" if with_curve is None else "S(B)",
        predicted_per_job_tokens_per_s=per_job,
        predicted_one_s_tokens_per_s=one_s,
    )


def _run_inputs(inputs: analytic.ModelInputs, report: dict) -> analytic.ModelInputs:
    """The workload's realised alpha and verify time (the calibration slices' when measured)."""
    alpha = analytic.alpha_from_mean_accepted(report["mean_accepted"], inputs.gamma)
    verify_ms = report["calibration"]["verify_ms"] or report["verify_ms"]
    return replace(inputs, alpha=alpha, verify_s=verify_ms / 1e3)


def emulated_prediction(inputs: analytic.ModelInputs, report: dict, calibrated: bool) -> float:
    """The model's throughput for one sweep step, from inputs measured outside its window.

    ``calibrated``: S(d) and the verify time from this step's calibration slices (same N, same
    hub, alternating with the window's slices); else the sweep's one S(d) and the window's
    verify time. S(d) is not one number on a shared CPU: the drafter runs colder with
    idle gaps between jobs (small N) than back to back (large N), and this VM's speed drifts
    within a sweep. The acceptance draws are the workload's: the model takes the window's
    realised E[L] (a short run's sample of alpha = 0.7 can be 10% off).
    """
    alpha = analytic.alpha_from_mean_accepted(report["mean_accepted"], inputs.gamma)
    run_inputs = replace(inputs, alpha=alpha, verify_s=report["verify_ms"] / 1e3)
    calibration = report["calibration"]
    if calibrated and calibration["draft_service_s"] is not None:
        run_inputs = replace(run_inputs, draft_s=calibration["draft_service_s"])
    if calibrated and calibration["verify_ms"] is not None:
        run_inputs = replace(run_inputs, verify_s=calibration["verify_ms"] / 1e3)
    return analytic.predict(run_inputs, report["n_targets"]).system_tokens_per_s


def curve_prediction(
    inputs: analytic.ModelInputs, report: dict, curve: dict[int, float]
) -> float | None:
    """The model with S(B) for one step of the batched sweep (None without a point)."""
    max_batch = report.get("max_batch", 1)
    with_curve = batched_inputs(_run_inputs(inputs, report), max_batch, curve.items())
    if with_curve is None:
        return None
    return analytic.predict(with_curve, report["n_targets"]).system_tokens_per_s


def latency_steadiness(runs: list[dict], one_to_one: dict, n_full: int) -> dict:
    """Per-token latency std: one hub at the measured N_full against N_full 1:1 pairs on the
    same machine, and against a single 1:1 pair (the N = 1 run)."""
    single = next(r for r in runs if r["n_targets"] == 1)
    full = min(runs, key=lambda r: abs(r["n_targets"] - n_full))
    return {
        "at_n_full": full["latency_ms"]["std"],
        "n_full_run": full["n_targets"],
        "one_to_one_same_machine": one_to_one["latency_ms"]["std"],
        "single_pair": single["latency_ms"]["std"],
        "cv_at_n_full": full["latency_ms"]["std"] / full["latency_ms"]["mean"],
        "cv_one_to_one_same_machine": one_to_one["latency_ms"]["std"]
        / one_to_one["latency_ms"]["mean"],
    }


_EMULATED_KEYS = (
    "system_tokens_per_s",
    "per_target_tokens_per_s",
    "hub_busy_fraction",
    "acceptance_rate",
    "mean_accepted",
    "latency_ms",
    "bytes_per_round",
    "queue_wait_ms",
)


def saturation(runs: list[dict], inputs: analytic.ModelInputs) -> dict:
    """Measured N_full against the model's.

    Measured N_full is the first swept N at which the hub no longer idles (busy >= 0.95), the
    model's definition of the fully-loaded regime (T_idle = 0); the sweep's steps are powers of
    two, so the model's N_full matches when it lies within one step of it.
    """
    ns = [r["n_targets"] for r in runs]
    measured = next((r["n_targets"] for r in runs if r["hub_busy_fraction"] >= BUSY_FULL), ns[-1])
    model = analytic.saturation_point(inputs)
    model_step = next((i for i, n in enumerate(ns) if n >= model), len(ns) - 1)
    return {
        "n_full_measured": measured,
        "n_full_model": model,
        "n_full_within_one_step": abs(ns.index(measured) - model_step) <= 1,
        "max_prediction_error": _max_error(runs, "predicted_system_tokens_per_s"),
        "max_prediction_error_one_s": _max_error(runs, "predicted_one_s_tokens_per_s"),
    }


def _max_error(runs: list[dict], key: str) -> float:
    return max(abs(r["system_tokens_per_s"] / r[key] - 1) for r in runs)


# ---------------------------------------------------------------------- summaries


def busy_from(runs: list[dict], n_full: int) -> dict[str, Any]:
    """The least busy fraction from N_full on, and whether it stays at the fully-loaded 0.95."""
    busy = [r["hub_busy_fraction"] for r in runs if r["n_targets"] >= n_full]
    least = min(busy) if busy else None
    return {
        "min_busy_from_n_full": least,
        "busy_from_n_full_ok": None if least is None else least >= BUSY_FULL,
    }


def rss_bound(runs: list[dict], after_sweep_mb: float) -> dict[str, Any]:
    """Bounded memory: the RSS after the sweep, every session closed, against the RSS at the
    peak N (the largest sampled while its sessions were open); at most 10% above it."""
    peak = max(runs, key=lambda r: r["n_targets"])
    ratio = after_sweep_mb / peak["hub_rss_peak_mb"]
    return {
        "peak_n": peak["n_targets"],
        "rss_at_peak_n_mb": peak["hub_rss_peak_mb"],
        "rss_after_sweep_mb": after_sweep_mb,
        "after_over_peak": ratio,
        "within_bound": ratio <= 1 + RSS_BOUND,
        "rss_first_mb": min(runs, key=lambda r: r["n_targets"])["hub_rss_peak_mb"],
    }


def saturated_tokens_per_s(runs: list[dict], n_full: int) -> float:
    """The hub's saturated throughput: the best system tokens/s from its N_full on."""
    return max(r["system_tokens_per_s"] for r in runs if r["n_targets"] >= n_full)


def compare_hubs(
    one: list[dict], batched: list[dict], one_full: int, batched_full: int
) -> dict[str, Any]:
    """Batched against one-at-a-time: saturated throughput ratio, and the ratio at every N
    (both ran at that N back to back, so drift hardly enters it)."""
    by_n = {r["n_targets"]: r["system_tokens_per_s"] for r in one}
    ratios = {
        str(r["n_targets"]): r["system_tokens_per_s"] / by_n[r["n_targets"]]
        for r in batched
        if by_n.get(r["n_targets"])
    }
    one_sat = saturated_tokens_per_s(one, one_full)
    batched_sat = saturated_tokens_per_s(batched, batched_full)
    return {
        "saturated_tokens_per_s": {ONE_AT_A_TIME: one_sat, BATCHED: batched_sat},
        "saturated_throughput_ratio": batched_sat / one_sat,
        "throughput_ratio_by_n": ratios,
    }


def hub_summary(
    runs: list[dict],
    inputs: analytic.ModelInputs,
    after_sweep_mb: float,
    max_batch: int,
    model_inputs: analytic.ModelInputs | None = None,
) -> dict[str, Any]:
    """One hub's figures over its sweep: N_full, errors, busy from N_full, RSS, waits."""
    summary = saturation(runs, model_inputs or inputs)
    return {
        "max_batch": max_batch,
        **summary,
        **busy_from(runs, summary["n_full_measured"]),
        "rss": rss_bound(runs, after_sweep_mb),
        "proposal_wait_ms": {str(r["n_targets"]): r["proposal_wait_ms"] for r in runs},
        "prediction_model": runs[-1].get("prediction_model", "per-job S(d)"),
    }


# ---------------------------------------------------------------------- report


def markdown(result: dict) -> str:
    """Both hubs' sweeps side by side, and the summary figures."""
    lines = [
        "| hub | N | system tok/s | model | busy | mean batch | proposal wait p50/p99 ms "
        "| hub RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if not r["mode"].startswith("emulated-"):
            continue
        wait = r["proposal_wait_ms"] or {}
        lines.append(
            f"| {r['mode'].removeprefix('emulated-')} (M={r['max_batch']}) | {r['n_targets']} | "
            f"{r['system_tokens_per_s']:.1f} | {r['predicted_system_tokens_per_s']:.1f} | "
            f"{r['hub_busy_fraction']:.2f} | {r['mean_batch_size'] or 0:.2f} | "
            f"{wait.get('p50', 0):.1f}/{wait.get('p99', 0):.1f} | {r['hub_rss_peak_mb']:.0f} |"
        )
    lines.append("")
    for hub, s in result["hubs"].items():
        lines.append(
            f"* {hub} (max-batch {s['max_batch']}): N_full measured {s['n_full_measured']}, "
            f"model {s['n_full_model']}; largest model error {100 * s['max_prediction_error']:.1f}%"
            f" ({s['prediction_model']}); least busy from N_full on "
            f"{s['min_busy_from_n_full']:.3f}; RSS at N={s['rss']['peak_n']} "
            f"{s['rss']['rss_at_peak_n_mb']:.0f} MiB, after the sweep "
            f"{s['rss']['rss_after_sweep_mb']:.0f} MiB ({s['rss']['after_over_peak']:.2f}x)"
        )
    lines.append(
        f"* saturated throughput batched / one-at-a-time: "
        f"{result['saturated_throughput_ratio']:.2f}x"
    )
    for kind, d in (result.get("service") or {}).get("drafters", {}).items():
        lines.append(
            f"* S(B) {kind}: S(8)/S(1) {d['s8_over_s1']:.2f}, S(32)/S(1) {d['s32_over_s1']:.2f}"
        )
    lines += bench_gamma.markdown(result)
    lines += bench_trees.markdown(result.get("tree_comparison"))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Throughput vs N for both hubs with the model's predictions; S(B) of the drafters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scripts.bench.service import plot_curves

    gamma, trees = result.get("gamma_comparison"), result.get("tree_comparison")
    panels = 2 + bool(gamma) + bool(trees)
    fig, axes = plt.subplots(1, panels, figsize=(6.3 * panels, 4.8))
    ax, ax_s = axes[0], axes[1]
    if gamma:
        bench_gamma.plot(gamma, axes[2])
    if trees:
        bench_trees.plot(trees, axes[-1])
    for hub, style in ((ONE_AT_A_TIME, "C0"), (BATCHED, "C1")):
        runs = [r for r in result["runs"] if r["mode"] == f"emulated-{hub}"]
        if not runs:
            continue
        ns = [r["n_targets"] for r in runs]
        label = f"{hub} (max-batch {runs[0]['max_batch']})"
        ax.plot(ns, [r["system_tokens_per_s"] for r in runs], "o-", c=style, label=label)
        ax.plot(
            ns,
            [r["predicted_system_tokens_per_s"] for r in runs],
            "--",
            c=style,
            label=f"{hub}: model ({runs[0]['prediction_model']})",
        )
        ax.axvline(result["hubs"][hub]["n_full_measured"], ls=":", c=style)
        ax.axvline(result["hubs"][hub]["n_full_model"], ls="-.", c=style, lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="emulated targets N",
        ylabel="system tokens/s",
        title="throughput vs N (N_full dotted: measured, dash-dot: model)",
    )
    ax.legend(fontsize=8)
    if result.get("service"):
        plot_curves(result["service"], ax_s)
    curve = result["model_inputs"].get("service_curve")
    if curve:
        ax_s.scatter(
            [b for b, _ in curve],
            [1e3 * s for _, s in curve],
            c="k",
            marker="x",
            zorder=3,
            label="batched hub (sweep calibration)",
        )
    one = result.get("model_inputs_one_at_a_time")
    if one:
        ax_s.scatter(
            [1],
            [1e3 * one["draft_s"]],
            c="red",
            marker="+",
            s=80,
            zorder=3,
            label="one-at-a-time hub S(1)",
        )
    ax_s.legend(fontsize=8)
    ax_s.set(title="S(B): one batch of B sessions, gamma 4")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
