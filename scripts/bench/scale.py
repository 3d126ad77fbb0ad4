"""The scale suite: emulated targets against the real hub, N swept, the model beside each step.

Two hubs on the same draft CPU, swept in one invocation and alternating at every N (this
machine's speed drifts): the one-at-a-time hub (``--max-batch 1``, the baseline) and the
batched hub (``--max-batch`` M, default 64). Per run: throughput, the hub's busy fraction, mean
batch size and S(B) over the window, each round's wait for its proposal (p50/p99), the hub's RSS;
per hub: N_full (model and measured), the model's largest error, the RSS bound; across hubs the
saturated throughput ratio. The S(B) curves of the draft LLM and the EAGLE head are measured
first, in process (scripts/bench/service.py), on the same CPU.

Run through ``python -m scripts.bench.run --suite scale`` (``make bench-scale``). With
``--draft-profile D.json`` the swept hubs draft with ``--draft-kind emulated`` at that profile's
S(B, g), and with ``--target-profile T.json`` the emulated targets verify and decode alone at
its V(1, g) and T(1): the sweep then replays another machine's costs (docs/planning.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from edge.handshake import TargetInfo
from scripts.bench import gamma as bench_gamma
from scripts.bench import trees as bench_trees
from scripts.bench.common import (
    NULL_HUB_ARGS,
    BenchConfig,
    Hub,
    hub_overhead,
    hub_stats,
    link_round_ms,
    run_record,
    sweep_order,
)
from scripts.bench.harness import Processes, rss_mb, start_hub_set, start_hubs, stop
from starsd import analytic, models, transport
from starsd.service import ServiceCurve
from starsd.stats import latency_summary

# The two hubs compared, by record mode; "batched" runs with cfg.max_batch.
ONE_AT_A_TIME, BATCHED = "one-at-a-time", "batched"
HUBS = (ONE_AT_A_TIME, BATCHED)
AUTO_HUB = "auto"  # the batched hub under --gamma auto (fixed gammas run on "batched")
TREES_ON_HUB = "trees-on"  # the auto hub under --tree on (the tree comparison's)
BUSY_FULL = 0.95  # the model's fully-loaded regime, as measured: the hub no longer idles
QUICK_OVERHEAD_ROUNDS = 300
# The emulated targets append random tokens, so a pre-drafted branch (a guess at the verdict)
# would never be used: pre-drafting would only take the hubs' CPU while they idle. Off, so the
# sweep measures batching alone.
NO_PREDRAFT = ("--predraft-branches", "0")
RSS_BOUND = 0.10  # RSS after the sweep (sessions closed) at most 10% above the peak N's


def emulated_run(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    endpoint: str,
    n: int,
    cpus: set[int] | None,
    tag: str = "",
    extra: Sequence[str] = (),
) -> dict:
    """``python -m scripts.emulate.emulated`` with ``n`` targets; its JSON report. ``extra``: more
    options for the emulator, after (so overriding) the suite's own."""
    return _emulators(
        cfg, procs, work, info, [endpoint], n, cpus, cfg.warmup, tag=tag, extra=extra
    )[0]


def placement() -> tuple[set[int] | None, set[int] | None]:
    """CPUs for (hubs, emulated targets) in the scale suite.

    The first CPU plays the draft accelerator: the one hub, or the N 1:1 hubs time-sharing it;
    the emulated targets stand for other machines and get the remaining CPUs. Without pinning
    the 1:1 hubs would draft on every core at once, i.e. with more draft hardware than the hub
    they are compared with.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("[scale] one CPU: hubs and emulated targets share it (no draft device of its own)")
        return None, None
    return {cpus[0]}, set(cpus[1:])


def _emulators(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    endpoints: list[str],
    n: int,
    cpus: set[int] | None,
    warmup: float,
    tag: str = "",
    extra: Sequence[str] = (),
) -> list[dict]:
    """One emulator process per endpoint, all at once, ``n`` targets each; their reports.
    ``extra`` options come last, so they override the suite's (argparse keeps the last)."""
    verify_ms, duration = cfg.verify_ms, cfg.duration
    running = []
    for i, endpoint in enumerate(endpoints):
        out = work / f"emulated{tag}-{n}-{verify_ms}-{len(endpoints)}-{i}.json"
        args = [
            "-m",
            "scripts.emulate.emulated",
            "--hub",
            endpoint,
            "--vocab-size",
            str(info.vocab_size),
            "--tokenizer",
            info.tokenizer,
            "--targets",
            str(n),
            "--alpha",
            str(cfg.alpha),
            "--verify-ms",
            str(verify_ms),
            "--gamma",
            str(cfg.gamma),
            "--duration",
            str(duration),
            "--calibration",
            str(cfg.calibration),
            "--warmup",
            str(warmup),
            "--seed",
            str(i),
            "--out",
            str(out),
            *(["--profile", cfg.target_profile] if cfg.target_profile else []),
            *extra,
        ]
        running.append((procs.start(args, out.with_suffix(".log"), cpus=cpus), out))
    for proc, out in running:
        if proc.wait(timeout=duration + cfg.calibration + 180) != 0:
            raise RuntimeError(out.with_suffix(".log").read_text()[-3000:])
    return [dict(json.loads(out.read_text())) for _, out in running]


def emulated_one_to_one(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    n: int,
    cpus: tuple[set[int] | None, set[int] | None],
) -> dict:
    """The bursty baseline on the same draft hardware: ``n`` hubs, one emulated target each.

    The hubs share the CPU the one hub had (see :func:`placement`), but every hub drafts, then
    waits for its own target's verdict (draft-then-verify), and they time-share that CPU.
    """
    print(f"[scale] distributed 1:1: {n} hubs x 1 emulated target ...", flush=True)
    hubs = start_hubs(
        procs,
        cfg.draft,
        [work / f"hub-1to1-{i}.log" for i in range(n)],
        "--gamma",
        str(cfg.gamma),
        *NO_PREDRAFT,
        cpus=cpus[0],
    )
    reports = _emulators(cfg, procs, work, info, [ep for _, ep in hubs], 1, cpus[1], warmup=2.0)
    for proc, _ in hubs:
        stop(proc)
    latencies = [x / 1e3 for r in reports for x in r["token_latency_ms"]]
    rounds = sum(r["rounds"] for r in reports)
    return run_record(
        "distributed-1to1",
        n,
        system_tokens_per_s=sum(r["system_tokens_per_s"] for r in reports),
        per_target_tokens_per_s=sum(r["system_tokens_per_s"] for r in reports) / n,
        hub_busy_fraction=sum(r["hub_busy_fraction"] for r in reports) / n,
        acceptance_rate=sum(r["acceptance_rate"] * r["rounds"] for r in reports) / rounds,
        mean_accepted=sum(r["mean_accepted"] * r["rounds"] for r in reports) / rounds,
        latency_ms=latency_summary(latencies),
        bytes_per_round=sum(r["bytes_per_round"] * r["rounds"] for r in reports) / rounds,
    )


# ---------------------------------------------------------------------- the sweep


class Phases:
    """Wall seconds per named phase of the suite (``with phases("name"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - started
            print(f"[phase] {name}: {self.seconds[name]:.1f} s", flush=True)


class RssSampler:
    """The peak RSS of a process while the ``with`` block runs (sampled every ``interval``)."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval = pid, interval
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def __enter__(self) -> RssSampler:
        self.peak_mb = rss_mb(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, rss_mb(self.pid))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak_mb = max(self.peak_mb, rss_mb(self.pid))
            except (FileNotFoundError, ProcessLookupError):  # the hub exited: the run fails
                return


def wait_sessions_closed(endpoint: str, info: TargetInfo, timeout: float = 15.0) -> int:
    """Poll the hub until it holds no session (its targets are gone); the sessions left."""
    deadline = time.monotonic() + timeout
    while True:
        sessions = transport.run_loop(hub_stats(endpoint, info)).sessions
        if sessions == 0 or time.monotonic() > deadline:
            return sessions
        time.sleep(0.25)


def suite_hubs(
    cfg: BenchConfig, work: Path, cpus: tuple[set[int] | None, set[int] | None]
) -> dict[str, tuple[Path, list[str], set[int] | None]]:
    """The suite's hubs: a null hub for the overhead probe (unpinned) and one for the link time
    (on the hubs' CPU), then the two swept hubs, which differ only in --max-batch, and the
    batched hub under --gamma auto (the gamma comparison's; the fixed gammas run on the swept
    batched hub, which keeps the gamma an OPEN names)."""
    common = ["--model", cfg.draft, "--max-sessions", "4096", *NO_PREDRAFT, *replayed(cfg)]
    null = ["--model", cfg.draft, *NULL_HUB_ARGS]
    return {
        "null": (work / "hub-null.log", null, None),
        "null-pinned": (work / "hub-null-pinned.log", null, cpus[0]),
        **{
            h: (
                work / f"hub-scale-{h}.log",
                [*common, "--gamma", str(cfg.gamma), "--max-batch", str(m)],
                cpus[0],
            )
            for h, m in max_batches(cfg).items()
        },
        AUTO_HUB: (
            work / "hub-scale-auto.log",
            [*common, "--gamma", "auto", "--max-batch", str(cfg.max_batch)],
            cpus[0],
        ),
        TREES_ON_HUB: (
            work / "hub-scale-trees-on.log",
            [*common, "--gamma", "auto", "--tree", "on", "--max-batch", str(cfg.max_batch)],
            cpus[0],
        ),
    }


def replayed(cfg: BenchConfig) -> list[str]:
    """The swept hubs' drafting under ``cfg.draft_profile``: emulated at its S(B, g)."""
    if not cfg.draft_profile:
        return []
    return ["--draft-kind", "emulated", "--draft-profile", cfg.draft_profile]


def max_batches(cfg: BenchConfig) -> dict[str, int]:
    """Each swept hub's --max-batch."""
    return {ONE_AT_A_TIME: 1, BATCHED: cfg.max_batch}


def run_sweep(
    cfg: BenchConfig,
    procs: Processes,
    info: TargetInfo,
    hubs: dict[str, Hub],
    work: Path,
    cpus: tuple[set[int] | None, set[int] | None],
) -> dict[str, Any]:
    """Both hubs at every N, alternating; their reports (with RSS) and the after-sweep RSS.
    The hubs keep running (the gamma comparison uses the batched one)."""
    max_batch = max_batches(cfg)
    reports: dict[str, list[dict]] = {h: [] for h in HUBS}
    for _, n, hub in sweep_order(cfg.scale_ns, HUBS):
        proc, endpoint = hubs[hub]
        t0 = time.perf_counter()
        with RssSampler(proc.pid) as rss:
            report = emulated_run(cfg, procs, work, info, endpoint, n, cpus[1], tag=f"-{hub}")
        report.update(
            max_batch=max_batch[hub], hub_rss_peak_mb=rss.peak_mb, hub_rss_after_mb=rss_mb(proc.pid)
        )
        reports[hub].append(report)
        print(
            f"[scale] {hub} hub (max-batch {max_batch[hub]}), {n} emulated targets: "
            f"{report['system_tokens_per_s']:.0f} tok/s, busy {report['hub_busy_fraction']:.2f},"
            f" batch {report['mean_batch_size'] or 0:.1f}, RSS {rss.peak_mb:.0f} MiB "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    after: dict[str, dict[str, Any]] = {}
    for hub, (proc, endpoint) in hubs.items():
        left = wait_sessions_closed(endpoint, info)
        after[hub] = {"rss_mb": rss_mb(proc.pid), "sessions_left": left}
    return {"reports": reports, "after": after, "max_batch": max_batch}


def service_curves(
    cfg: BenchConfig, procs: Processes, work: Path, cpus: set[int] | None
) -> dict[str, Any] | None:
    """S(B) of the draft LLM and the EAGLE head, in process (scripts/bench/service.py); None
    when the hubs replay a draft profile (its S(B, g) is then what they draft at)."""
    if cfg.draft_profile:
        print(f"[scale] S(B) from {cfg.draft_profile} (the hubs replay it)", flush=True)
        return None
    print("[scale] S(B) of the drafters in process (scripts/bench/service.py) ...", flush=True)
    out = work / "service.json"
    args = [
        "-m",
        "scripts.bench.service",
        "--draft",
        cfg.draft,
        "--target",
        cfg.target,
        "--eagle",
        cfg.eagle,
        "--gamma",
        str(cfg.gamma),
        "--out",
        str(out),
        "--no-plot",
        *(["--quick", "--repeats", "5", "--no-memory"] if cfg.quick else []),
    ]
    proc = procs.start(args, work / "service.log", cpus=cpus)
    if proc.wait(timeout=900) != 0:
        print(f"[scale] S(B) measurement failed:\n{(work / 'service.log').read_text()[-2000:]}")
        return None
    result: dict[str, Any] = json.loads(out.read_text())
    for kind, d in result["drafters"].items():
        print(
            f"[scale]   {kind}: "
            + ", ".join(f"S({r['batch']}) {r['median_ms']:.1f} ms" for r in d["rows"]),
            flush=True,
        )
    return result


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


def suite_scale(cfg: BenchConfig, procs: Processes, work: Path) -> dict:
    """Emulated targets against both real hubs: N swept, the model's prediction beside each.

    The model's inputs come from the same run but never from the window it predicts: the link
    time is the null-drafter round (bare echo plus the hub's own path) measured with the sweep's
    CPU placement; S(d) and the verify time come from each step's calibration slices (see
    :func:`emulated_prediction`); the sweep-wide S(d) sets the model's N_full. The batched hub's
    model takes S(B) from the calibration slices of its whole sweep.
    """
    target = models.load_tokenizer_info(cfg.target)  # the emulated targets claim its tokenizer
    info = TargetInfo("bench", target.vocab_size, target.tokenizer_fingerprint)
    phases = Phases()
    cpus = placement()
    with phases("hubs_start"):  # every hub of the suite loads at once; they idle until used
        hubs = start_hub_set(procs, suite_hubs(cfg, work, cpus))
    with phases("hub_overhead"):
        # (the quick sweep of two hubs needs the time: fewer rounds of the overhead probe)
        rounds = QUICK_OVERHEAD_ROUNDS if cfg.quick else None
        overhead = hub_overhead(cfg, procs, work, info, rounds, hubs["null"])
    with phases("link"):
        link_ms = link_round_ms(cfg, procs, work, info, cpus, hubs["null-pinned"])
    with phases("service"):
        service = service_curves(cfg, procs, work, cpus[0])
    with phases("sweep"):
        sweep = run_sweep(cfg, procs, info, {h: hubs[h] for h in HUBS}, work, cpus)

    def emulate_on(hub: str) -> bench_gamma.Emulate:
        return lambda n, tag, extra: emulated_run(
            cfg, procs, work, info, hubs[hub][1], n, cpus[1], tag, extra
        )

    with phases("gamma"):
        gamma_reports = bench_gamma.run_comparison(cfg, emulate_on(BATCHED), emulate_on(AUTO_HUB))
    with phases("switch"):
        switch_report = bench_gamma.run_switch(cfg, emulate_on(AUTO_HUB))
    with phases("trees"):
        tree_reports = bench_trees.run_comparison(
            cfg, emulate_on(AUTO_HUB), emulate_on(TREES_ON_HUB)
        )
    for name, (proc, _) in hubs.items():
        if name not in ("null", "null-pinned"):  # (those were stopped after their probes)
            stop(proc)
    reports, after = sweep["reports"], sweep["after"]
    # c, the hub's serial cost per message when a batch's DRAFTs arrive back to back: measured
    # by the overhead probe, outside the sweep's windows
    per_message_s = overhead["back_to_back"]["added_ms"] / 1e3
    inputs = {
        h: replace(sweep_inputs(cfg, reports[h], link_ms), per_message_s=per_message_s)
        for h in HUBS
    }
    curve = pooled_points(curve_points(r["calibration"]) for r in reports[BATCHED])
    runs = {
        ONE_AT_A_TIME: [
            emulated_record(inputs[ONE_AT_A_TIME], r, ONE_AT_A_TIME) for r in reports[ONE_AT_A_TIME]
        ],
        BATCHED: [emulated_record(inputs[BATCHED], r, BATCHED, curve) for r in reports[BATCHED]],
    }
    batched_model = batched_inputs(inputs[BATCHED], cfg.max_batch, curve.items())
    summaries = {
        h: hub_summary(
            runs[h],
            inputs[h],
            after[h]["rss_mb"],
            sweep["max_batch"][h],
            batched_model if h == BATCHED else None,
        )
        for h in HUBS
    }
    for h in HUBS:
        summaries[h]["sessions_left_after_sweep"] = after[h]["sessions_left"]
    base = summaries[ONE_AT_A_TIME]
    one_to_one, steadiness = None, None
    if not cfg.quick:  # 20-25 s that the quick sweep of two hubs has no room for
        with phases("one_to_one"):
            one_to_one = emulated_one_to_one(cfg, procs, work, info, base["n_full_measured"], cpus)
        steadiness = latency_steadiness(runs[ONE_AT_A_TIME], one_to_one, base["n_full_measured"])
    top = summaries[BATCHED]  # the default hub's figures, where one hub's were before
    gamma_inputs = bench_gamma.model_inputs(cfg, batched_model, gamma_reports)
    tree_inputs = (
        None
        if gamma_inputs is None
        else bench_trees.tree_inputs(gamma_inputs, tree_reports, bench_trees.hub_shape())
    )
    return {
        "runs": [
            *runs[ONE_AT_A_TIME],
            *runs[BATCHED],
            *([one_to_one] if one_to_one else []),
            *bench_gamma.records(gamma_reports, gamma_inputs),
            *bench_trees.records(tree_reports, gamma_inputs, tree_inputs),
        ],
        # the batched hub's model with its S(B) (what `make analytic` reads), then the baseline's
        "model_inputs": analytic.inputs_as_json(batched_model or inputs[BATCHED]),
        "model_inputs_one_at_a_time": analytic.inputs_as_json(inputs[ONE_AT_A_TIME]),
        **{
            k: top[k]
            for k in (
                "n_full_measured",
                "n_full_model",
                "n_full_within_one_step",
                "max_prediction_error",
                "max_prediction_error_one_s",
            )
        },
        "hubs": summaries,
        **compare_hubs(
            runs[ONE_AT_A_TIME],
            runs[BATCHED],
            base["n_full_measured"],
            summaries[BATCHED]["n_full_measured"],
        ),
        "service": service,
        # the one-at-a-time hub at its N_full against as many 1:1 pairs; null with --quick
        "latency_std_ms": steadiness,
        "hub_overhead": overhead,
        "link_round_ms": link_ms,
        "placement": {"hubs": sorted(cpus[0] or []), "targets": sorted(cpus[1] or [])},
        # fixed gammas vs --gamma auto per N, and the acceptance switch (scripts/bench/gamma.py)
        "gamma_comparison": bench_gamma.compare(gamma_reports, gamma_inputs),
        "alpha_switch": bench_gamma.switch_summary(switch_report, gamma_inputs),
        "gamma_model_inputs": None
        if gamma_inputs is None
        else analytic.inputs_as_json(gamma_inputs),
        # --tree auto vs chains only vs --tree on per N (scripts/bench/trees.py)
        "tree_comparison": bench_trees.compare(tree_reports, gamma_inputs, tree_inputs),
        "phase_s": phases.seconds,
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
