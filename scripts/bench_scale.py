"""The scale suite: emulated targets against the real hub, N swept, the model beside each step.

Run through ``python scripts/bench.py --suite scale`` (``make bench-scale``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

from bench_common import BenchConfig, hub_overhead, link_round_ms, run_record
from harness import REPO, Processes, start_hub, start_hubs, stop

from edge.client import TargetInfo
from starsd import analytic, models
from starsd.stats import latency_summary


def emulated_run(cfg: BenchConfig, procs: Processes, work: Path, info: TargetInfo,
                 endpoint: str, n: int, cpus: set[int] | None) -> dict:  # fmt: skip
    """``python scripts/emulated.py`` with ``n`` targets; its JSON report."""
    return _emulators(cfg, procs, work, info, [endpoint], n, cpus, warmup=1.0)[0]


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


def _emulators(cfg: BenchConfig, procs: Processes, work: Path, info: TargetInfo,
               endpoints: list[str], n: int, cpus: set[int] | None, warmup: float
               ) -> list[dict]:  # fmt: skip
    """One emulator process per endpoint, all at once, ``n`` targets each; their reports."""
    verify_ms, duration = cfg.verify_ms, cfg.duration
    running = []
    for i, endpoint in enumerate(endpoints):
        out = work / f"emulated-{n}-{verify_ms}-{len(endpoints)}-{i}.json"
        args = [str(REPO / "scripts" / "emulated.py"), "--hub", endpoint, "--vocab-size",
                str(info.vocab_size), "--tokenizer", info.tokenizer, "--targets",
                str(n), "--alpha", str(cfg.alpha), "--verify-ms", str(verify_ms), "--gamma",
                str(cfg.gamma), "--duration", str(duration), "--calibration",
                str(cfg.calibration), "--warmup", str(warmup), "--seed", str(i), "--out",
                str(out)]  # fmt: skip
        running.append((procs.start(args, out.with_suffix(".log"), cpus=cpus), out))
    for proc, out in running:
        if proc.wait(timeout=duration + cfg.calibration + 120) != 0:
            raise RuntimeError(out.with_suffix(".log").read_text()[-3000:])
    return [dict(json.loads(out.read_text())) for _, out in running]


def emulated_one_to_one(cfg: BenchConfig, procs: Processes, work: Path, info: TargetInfo, n: int,
                        cpus: tuple[set[int] | None, set[int] | None]) -> dict:  # fmt: skip
    """The bursty baseline on the same draft hardware: ``n`` hubs, one emulated target each.

    The hubs share the CPU the one hub had (see :func:`placement`), but every hub drafts, then
    waits for its own target's verdict (draft-then-verify), and they time-share that CPU.
    """
    print(f"[scale] distributed 1:1: {n} hubs x 1 emulated target ...", flush=True)
    hubs = start_hubs(procs, cfg.draft, [work / f"hub-1to1-{i}.log" for i in range(n)],
                      "--gamma", str(cfg.gamma), cpus=cpus[0])  # fmt: skip
    reports = _emulators(cfg, procs, work, info, [ep for _, ep in hubs], 1, cpus[1], warmup=2.0)
    for proc, _ in hubs:
        stop(proc)
    latencies = [x / 1e3 for r in reports for x in r["token_latency_ms"]]
    rounds = sum(r["rounds"] for r in reports)
    return run_record(
        "distributed-1to1", n,
        system_tokens_per_s=sum(r["system_tokens_per_s"] for r in reports),
        per_target_tokens_per_s=sum(r["system_tokens_per_s"] for r in reports) / n,
        hub_busy_fraction=sum(r["hub_busy_fraction"] for r in reports) / n,
        acceptance_rate=sum(r["acceptance_rate"] * r["rounds"] for r in reports) / rounds,
        mean_accepted=sum(r["mean_accepted"] * r["rounds"] for r in reports) / rounds,
        latency_ms=latency_summary(latencies),
        bytes_per_round=sum(r["bytes_per_round"] * r["rounds"] for r in reports) / rounds,
    )  # fmt: skip


def suite_scale(cfg: BenchConfig, procs: Processes, work: Path) -> dict:
    """Emulated targets against the real hub: N swept, the model's prediction beside each.

    The model's inputs come from the same run but never from the window it predicts: the link
    time is the null-drafter round (bare echo plus the hub's own path) measured with the sweep's
    CPU placement; S(d) and the verify time come from each step's calibration slices (see
    :func:`emulated_prediction`); the sweep-wide S(d) sets the model's N_full.
    """
    target = models.load_tokenizer_info(cfg.target)  # the emulated targets claim its tokenizer
    info = TargetInfo("bench", target.vocab_size, target.tokenizer_fingerprint)
    overhead = hub_overhead(cfg, procs, work, info)
    cpus = placement()
    link_ms = link_round_ms(cfg, procs, work, info, cpus)
    hub, endpoint = start_hub(procs, cfg.draft, work / "hub-scale.log", "--gamma",
                              str(cfg.gamma), "--max-sessions", "4096", cpus=cpus[0])  # fmt: skip
    reports = []
    for n in cfg.scale_ns:
        print(f"[scale] {n} emulated targets ...", flush=True)
        reports.append(emulated_run(cfg, procs, work, info, endpoint, n, cpus[1]))
    stop(hub)
    draft_s = sum(r["hub_busy_s"] for r in reports) / sum(r["hub_jobs"] for r in reports)
    verify_s = sum(r["verify_ms"] for r in reports) / len(reports) / 1e3
    inputs = analytic.ModelInputs(cfg.alpha, cfg.gamma, draft_s, verify_s, link_ms / 1e3,
                                  cfg.verify_ms / 1e3)  # fmt: skip
    runs = [emulated_record(inputs, r) for r in reports]
    summary = saturation(runs, inputs)
    one_to_one = emulated_one_to_one(cfg, procs, work, info, summary["n_full_measured"], cpus)
    return {"runs": [*runs, one_to_one], "model_inputs": asdict(inputs), **summary,
            "latency_std_ms": latency_steadiness(runs, one_to_one, summary["n_full_measured"]),
            "hub_overhead": overhead, "link_round_ms": link_ms,
            "placement": {"hubs": sorted(cpus[0] or []), "targets": sorted(cpus[1] or [])}}


def emulated_record(inputs: analytic.ModelInputs, report: dict) -> dict:
    """One sweep step's record: what the window measured, and the model's prediction of it."""
    calibration = report["calibration"]
    return run_record(
        "emulated", report["n_targets"], **{k: report[k] for k in _EMULATED_KEYS},
        draft_service_ms=1e3 * report["draft_service_s"], verify_ms=report["verify_ms"],
        calibrated_draft_service_ms=None if calibration["draft_service_s"] is None
        else 1e3 * calibration["draft_service_s"],
        predicted_system_tokens_per_s=emulated_prediction(inputs, report, calibrated=True),
        predicted_one_s_tokens_per_s=emulated_prediction(inputs, report, calibrated=False),
    )  # fmt: skip


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


def latency_steadiness(runs: list[dict], one_to_one: dict, n_full: int) -> dict:
    """Per-token latency std: one hub at the measured N_full against N_full 1:1 pairs on the
    same machine, and against a single 1:1 pair (the N = 1 run)."""
    single = next(r for r in runs if r["n_targets"] == 1)
    full = min(runs, key=lambda r: abs(r["n_targets"] - n_full))
    return {"at_n_full": full["latency_ms"]["std"], "n_full_run": full["n_targets"],
            "one_to_one_same_machine": one_to_one["latency_ms"]["std"],
            "single_pair": single["latency_ms"]["std"],
            "cv_at_n_full": full["latency_ms"]["std"] / full["latency_ms"]["mean"],
            "cv_one_to_one_same_machine":
                one_to_one["latency_ms"]["std"] / one_to_one["latency_ms"]["mean"]}  # fmt: skip


_EMULATED_KEYS = ("system_tokens_per_s", "per_target_tokens_per_s", "hub_busy_fraction",
                  "acceptance_rate", "mean_accepted", "latency_ms", "bytes_per_round",
                  "queue_wait_ms")  # fmt: skip


def saturation(runs: list[dict], inputs: analytic.ModelInputs) -> dict:
    """Measured N_full against the model's.

    Measured N_full is the first swept N at which the hub no longer idles (busy >= 0.95), the
    model's definition of the fully-loaded regime (T_idle = 0); the sweep's steps are powers of
    two, so the model's N_full matches when it lies within one step of it.
    """
    ns = [r["n_targets"] for r in runs]
    measured = next((r["n_targets"] for r in runs if r["hub_busy_fraction"] >= 0.95), ns[-1])
    model = analytic.saturation_point(inputs)
    model_step = next((i for i, n in enumerate(ns) if n >= model), len(ns) - 1)
    return {"n_full_measured": measured, "n_full_model": model,
            "n_full_within_one_step": abs(ns.index(measured) - model_step) <= 1,
            "max_prediction_error": _max_error(runs, "predicted_system_tokens_per_s"),
            "max_prediction_error_one_s": _max_error(runs, "predicted_one_s_tokens_per_s")}


def _max_error(runs: list[dict], key: str) -> float:
    return max(abs(r["system_tokens_per_s"] / r[key] - 1) for r in runs)
