"""StarSD benchmarks: every mode side by side in one run, next to the analytic model.

    python scripts/bench.py --suite main  [--quick]   # standalone, centralized, 1:1, one-for-many
    python scripts/bench.py --suite scale [--quick]   # emulated targets, N up to 128, N_full
    python scripts/bench.py --suite lan   [--quick]   # hub and targets in separate namespaces

Writes results/bench[-scale|-lan].json (``runs``: one record per (mode, N)) and PNG plots, and
prints a markdown table. Greedy decoding on the default model pair unless --target/--draft.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from harness import PROMPTS as HARNESS_PROMPTS
from harness import REPO, Processes, start_hub, start_hubs, stop, wait_for_line

from edge.client import HubClient, TargetInfo
from edge.verifier import TargetSequence
from starsd import analytic, models, transport
from starsd.drafter import Drafter, DraftJob
from starsd.protocol import Hello, SamplingParams, Stats
from starsd.stats import latency_summary

PROMPTS = HARNESS_PROMPTS[:6]


@dataclass(frozen=True)
class BenchConfig:
    """What scripts/bench.py is told."""

    suite: str
    target: str
    draft: str
    eagle: str = str(models.DEFAULT_TARGET_DIR.parent / "starsd-eagle")
    quick: bool = False
    gamma: int = 4
    max_new_tokens: int = 64
    ns: tuple[int, ...] = (1, 2, 3)
    scale_ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    alpha: float = 0.7
    verify_ms: float = 8.0
    duration: float = 4.0
    calibration: float = 2.0  # emulated runs: seconds of calibration slices around the window
    delay_ms: float = 1.0
    rate_mbit: float = 1000.0
    out_dir: str = "results"


def run_record(mode: str, n: int, **fields: Any) -> dict[str, Any]:
    """One ``runs`` record with every key of the JSON contract present."""
    base: dict[str, Any] = {
        "mode": mode, "n_targets": n, "system_tokens_per_s": None,
        "per_target_tokens_per_s": None, "predicted_system_tokens_per_s": None,
        "hub_busy_fraction": None, "acceptance_rate": None, "mean_accepted": None,
        "latency_ms": None, "bytes_per_round": None, "queue_wait_ms": None,
    }  # fmt: skip
    base.update(fields)
    return base


# ---------------------------------------------------------------------- in-process modes


def bench_standalone(target: models.LoadedModel, cfg: BenchConfig) -> tuple[dict, float]:
    """The target alone; returns its record and the mean decode step (T_ar)."""
    tokens, seconds, lat = 0, 0.0, []
    for prompt in PROMPTS:
        seq = TargetSequence(target, models.encode_text(target, prompt), SamplingParams(),
                             cfg.max_new_tokens)  # fmt: skip
        started = time.perf_counter()
        while not seq.done:
            seq.step()
        seconds += time.perf_counter() - started
        tokens += len(seq.generated)
        lat += seq.stats.token_latency_s
    rate = tokens / seconds
    return run_record("standalone", 1, system_tokens_per_s=rate, per_target_tokens_per_s=rate,
                      latency_ms=latency_summary(lat)), seconds / tokens  # fmt: skip


def bench_centralized(target: models.LoadedModel, drafter: Drafter, cfg: BenchConfig
                      ) -> tuple[dict, dict[str, float]]:  # fmt: skip
    """Draft and target in one process; also measures S(d) and the verify time per round.

    The same loop serves both backends: with EAGLE the target keeps its features and each
    job carries those the drafter has not seen, exactly as OPEN and DRAFT do over the wire.
    """
    eagle = drafter.feature_width > 0
    tokens = rounds = accepted = 0
    draft_s = verify_s = 0.0
    lat: list[float] = []
    started = time.perf_counter()
    for prompt in PROMPTS:
        ids = models.encode_text(target, prompt)
        seq = TargetSequence(target, ids, SamplingParams(), cfg.max_new_tokens, eagle)
        state = drafter.new_state(ids, SamplingParams(), cfg.gamma)
        job = DraftJob(b"", 0, state, 0, (), features=_features(seq, 0, eagle))
        while not seq.done:
            t0 = time.perf_counter()
            (proposal,) = drafter.propose([job])
            t1 = time.perf_counter()
            synced = seq.committed
            n, appended = seq.verify([int(t) for t in proposal.tokens], None)  # type: ignore[union-attr]
            verify_s += time.perf_counter() - t1
            draft_s += t1 - t0
            rounds, accepted = rounds + 1, accepted + n
            job = DraftJob(b"", job.seq + 1, state, n, tuple(appended),
                           features=_features(seq, synced - 1, eagle))  # fmt: skip
        tokens += len(seq.generated)
        lat += seq.stats.token_latency_s
    rate = tokens / (time.perf_counter() - started)
    record = run_record(
        "centralized", 1, system_tokens_per_s=rate, per_target_tokens_per_s=rate,
        acceptance_rate=accepted / (rounds * cfg.gamma), mean_accepted=accepted / rounds,
        latency_ms=latency_summary(lat), draft_kind=drafter.kind,
    )  # fmt: skip
    return record, {"draft_s": draft_s / rounds, "verify_s": verify_s / rounds,
                    "mean_accepted": accepted / rounds}  # fmt: skip


def _features(seq: TargetSequence, start: int, eagle: bool) -> Any:
    """The features a job carries (EAGLE only): positions ``start`` .. all but the last."""
    return seq.features(start, seq.committed - 1) if eagle else None


def eagle_drafter(cfg: BenchConfig) -> Drafter:
    """The hub's EAGLE drafter for the benchmark's target, built as the hub builds it."""
    from starsd import eagle
    from starsd.eagle_drafter import EagleDrafter

    head = eagle.load_eagle_head(cfg.eagle, cfg.target)
    return EagleDrafter(head, models.load_tokenizer_info(cfg.target).max_positions)


# ---------------------------------------------------------------------- multi-process modes


async def hub_stats(endpoint: str, info: TargetInfo) -> Stats:
    """One STATS reply from the hub at ``endpoint``."""
    ctx = transport.new_context()
    client = HubClient(ctx, endpoint, info)
    try:
        await client.connect()
        return await client.stats()
    finally:
        await client.aclose()
        ctx.term()


def busy_between(before: Stats, after: Stats) -> tuple[float, float]:
    """(hub busy fraction, mean queue wait ms) between two STATS replies."""
    wall = after.wall_s - before.wall_s
    jobs = max(after.jobs - before.jobs, 1)
    return ((after.busy_s - before.busy_s) / wall if wall > 0 else 0.0,
            1e3 * (after.queue_wait_s - before.queue_wait_s) / jobs)  # fmt: skip


def run_targets(cfg: BenchConfig, procs: Processes, work: Path, endpoints: list[str],
                tag: str, prefixes: list[list[str]] | None = None) -> list[list[dict]]:  # fmt: skip
    """One target process per endpoint, all at once, each on the full prompt set.

    ``prefixes`` (one per target) run a target elsewhere, e.g. ``ip netns exec NS``.
    """
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                               for i, p in enumerate(PROMPTS)))  # fmt: skip
    running = []
    for i, endpoint in enumerate(endpoints):
        out = work / f"{tag}-{i}.jsonl"
        args = ["-m", "edge.target", "--hub", endpoint, "--model", cfg.target, "--prompts",
                str(prompts), "--out", str(out), "--max-new-tokens", str(cfg.max_new_tokens),
                "--gamma", str(cfg.gamma)]  # fmt: skip
        prefix = prefixes[i] if prefixes else None
        running.append((procs.start(args, work / f"{tag}-{i}.log", prefix), out))
    rows = []
    for proc, out in running:
        if proc.wait(timeout=900) != 0:
            raise RuntimeError(f"{tag}: a target failed; see {out.with_suffix('.log')}")
        rows.append([json.loads(line) for line in out.read_text().splitlines()])
    return rows


def targets_record(mode: str, rows: list[list[dict]], gamma: int, **fields: Any) -> dict:
    """Aggregate target JSONL rows into a record (tokens/s from each sequence's own time)."""
    per_target, lat, rounds, accepted = [], [], 0, 0
    for target_rows in rows:
        tokens = sum(len(r["token_ids"]) for r in target_rows)
        seconds = sum(len(r["token_ids"]) / r["stats"]["tokens_per_s"] for r in target_rows)
        per_target.append(tokens / seconds)
        for r in target_rows:
            rounds += r["stats"]["rounds"]
            accepted += r["stats"]["accepted"]
            lat.append(r["stats"]["latency_ms"])
    return run_record(
        mode, len(rows), system_tokens_per_s=sum(per_target),
        per_target_tokens_per_s=sum(per_target) / len(rows),
        acceptance_rate=accepted / max(rounds * gamma, 1), mean_accepted=accepted / max(rounds, 1),
        latency_ms={k: sum(x[k] for x in lat) / len(lat) for k in ("mean", "p50", "p99", "std")},
        **fields,
    )  # fmt: skip


def proposal_bytes(gamma: int) -> float:
    """Bytes on the wire per greedy round: PROPOSAL + DRAFT, as encoded (plus ZMTP framing)."""
    import numpy as np

    from starsd import protocol

    tag = b"\x00" * protocol.TAG_BYTES
    sizes: list[protocol.Message] = [protocol.Proposal(tag, 1, np.zeros(gamma, np.int32)),
                                     protocol.Draft(tag, 1, 2, np.zeros(1, np.int32))]  # fmt: skip
    return float(sum(len(bytes(f)) + 2 for m in sizes for f in protocol.encode(m)))


# ---------------------------------------------------------------------- suites


def suite_main(cfg: BenchConfig, procs: Processes, work: Path) -> dict:
    """standalone, centralized, distributed 1:1 and one-for-many on real models."""
    torch.set_num_threads(1)
    target, draft = models.load_causal_lm(cfg.target), models.load_causal_lm(cfg.draft)
    print("[main] standalone and centralized (in process) ...", flush=True)
    standalone, t_ar = bench_standalone(target, cfg)
    central, measured = bench_centralized(target, Drafter(draft), cfg)
    central_eagle, measured_eagle = bench_centralized(target, eagle_drafter(cfg), cfg)
    info = TargetInfo("bench", target.vocab_size, target.tokenizer_fingerprint,
                      models.hidden_size(target))  # fmt: skip
    overhead = hub_overhead(cfg, procs, work, info)
    link = overhead["round_ms"] / 1e3
    alpha = analytic.alpha_from_mean_accepted(measured["mean_accepted"], cfg.gamma)
    inputs = analytic.ModelInputs(alpha, cfg.gamma, measured["draft_s"], measured["verify_s"],
                                  link, t_ar)  # fmt: skip
    tokens = analytic.expected_tokens_per_round(alpha, cfg.gamma)
    central["predicted_system_tokens_per_s"] = tokens / (inputs.draft_s + inputs.verify_s)
    runs = [standalone, central, central_eagle]
    plan = [("distributed-1to1", max(cfg.ns), "llm"), *[("one-for-many", n, "llm") for n in cfg.ns],
            ("one-for-many", max(cfg.ns), "eagle")]  # fmt: skip
    for mode, n, kind in plan:
        print(f"[main] {mode} ({kind} drafter) with {n} target process(es) ...", flush=True)
        runs.append(hub_run(cfg, procs, work, info, mode, n, inputs, kind))
    base = standalone["system_tokens_per_s"]
    return {"runs": runs, "model_inputs": asdict(inputs), "hub_overhead": overhead,
            "eagle": {"draft_ms_per_round": 1e3 * measured_eagle["draft_s"],
                      "llm_draft_ms_per_round": 1e3 * measured["draft_s"],
                      "mean_accepted": measured_eagle["mean_accepted"],
                      "llm_mean_accepted": measured["mean_accepted"]},
            "speedup_vs_standalone": {f"{_label(r)}/{r['n_targets']}":
                                      r["system_tokens_per_s"] / base for r in runs}}  # fmt: skip


def hub_run(cfg: BenchConfig, procs: Processes, work: Path, info: TargetInfo, mode: str, n: int,
            inputs: analytic.ModelInputs, kind: str = "llm") -> dict:  # fmt: skip
    """``n`` target processes and fresh hubs: one shared (one-for-many) or one each (1:1)."""
    n_hubs = 1 if mode == "one-for-many" else n
    model, extra = (cfg.eagle, ["--draft-kind", "eagle", "--target", cfg.target]
                    ) if kind == "eagle" else (cfg.draft, [])  # fmt: skip
    hubs = start_hubs(procs, model, [work / f"hub-{mode}-{kind}-{n}-{i}.log"
                                     for i in range(n_hubs)], "--gamma", str(cfg.gamma), *extra)
    endpoints = [ep for _, ep in hubs]
    before = [transport.run_loop(hub_stats(ep, info)) for ep in endpoints]
    rows = run_targets(cfg, procs, work, (endpoints * n)[:n], f"{mode}-{kind}-{n}")
    after = [transport.run_loop(hub_stats(ep, info)) for ep in endpoints]
    for proc, _ in hubs:
        stop(proc)
    decode_wall = max(sum(len(r["token_ids"]) / r["stats"]["tokens_per_s"] for r in t)
                      for t in rows)  # fmt: skip
    busy = sum(a.busy_s - b.busy_s for a, b in zip(after, before, strict=True)) / len(hubs)
    queue_ms = sum(busy_between(b, a)[1] for a, b in zip(after, before, strict=True)) / len(hubs)
    per_hub = 1 if mode == "distributed-1to1" else n  # targets each hub serves
    record = targets_record(
        mode, rows, cfg.gamma, hub_busy_fraction=min(1.0, busy / decode_wall),
        queue_wait_ms=queue_ms, bytes_per_round=proposal_bytes(cfg.gamma), draft_kind=kind,
        predicted_system_tokens_per_s=len(hubs) * analytic.predict(
            inputs, per_hub).system_tokens_per_s if kind == "llm" else None,
    )  # fmt: skip
    if kind == "eagle":  # features of the committed positions travel up with each DRAFT
        record["feature_bytes_per_round"] = (record["mean_accepted"] + 1) * info.feature_width * 2
        record["bytes_per_round"] += record["feature_bytes_per_round"]
    return record


def emulated_run(cfg: BenchConfig, procs: Processes, work: Path, info: TargetInfo,
                 endpoint: str, n: int, cpus: set[int] | None) -> dict:  # fmt: skip
    """``python -m edge.emulated`` with ``n`` targets; its JSON report."""
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
        args = ["-m", "edge.emulated", "--hub", endpoint, "--vocab-size", str(info.vocab_size),
                "--tokenizer", info.tokenizer, "--targets",
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
    target = models.load_causal_lm(cfg.target)
    info = TargetInfo("bench", target.vocab_size, target.tokenizer_fingerprint,
                      models.hidden_size(target))  # fmt: skip
    overhead = hub_overhead(cfg, procs, work, info)
    cpus = placement()
    placed = hub_overhead(cfg, procs, work, info, cpus) if cpus[0] else overhead
    hub, endpoint = start_hub(procs, cfg.draft, work / "hub-scale.log", "--gamma",
                              str(cfg.gamma), "--max-sessions", "4096", cpus=cpus[0])  # fmt: skip
    reports = []
    for n in cfg.scale_ns:
        print(f"[scale] {n} emulated targets ...", flush=True)
        reports.append(emulated_run(cfg, procs, work, info, endpoint, n, cpus[1]))
    stop(hub)
    draft_s = sum(r["hub_busy_s"] for r in reports) / sum(r["hub_jobs"] for r in reports)
    verify_s = sum(r["verify_ms"] for r in reports) / len(reports) / 1e3
    inputs = analytic.ModelInputs(cfg.alpha, cfg.gamma, draft_s, verify_s,
                                  placed["round_after_verify_ms"] / 1e3,
                                  cfg.verify_ms / 1e3)  # fmt: skip
    runs = [emulated_record(inputs, r) for r in reports]
    summary = saturation(runs, inputs)
    one_to_one = emulated_one_to_one(cfg, procs, work, info, summary["n_full_measured"], cpus)
    return {"runs": [*runs, one_to_one], "model_inputs": asdict(inputs), **summary,
            "latency_std_ms": latency_steadiness(runs, one_to_one, summary["n_full_measured"]),
            "hub_overhead": overhead, "link_round_ms": placed["round_after_verify_ms"],
            "placement": {"hubs": sorted(cpus[0] or []), "targets": sorted(cpus[1] or [])}}


def emulated_record(inputs: analytic.ModelInputs, report: dict) -> dict:
    """One sweep step's record: what the window measured, and the model's prediction of it."""
    calibration = report["calibration"]
    return run_record(
        "emulated", report["n_targets"], **{k: report[k] for k in _EMULATED_KEYS},
        draft_service_ms=1e3 * report["draft_service_s"], verify_ms=report["verify_ms"],
        calibrated_draft_service_ms=_scaled(calibration["draft_service_s"], 1e3),
        predicted_system_tokens_per_s=emulated_prediction(inputs, report, calibrated=True),
        predicted_one_s_tokens_per_s=emulated_prediction(inputs, report, calibrated=False),
    )  # fmt: skip


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def emulated_prediction(inputs: analytic.ModelInputs, report: dict, calibrated: bool) -> float:
    """The model's throughput for one sweep step, from inputs measured before its window.

    ``calibrated``: S(d) and the verify time from this step's calibration phase (the second half
    of its warm-up: same N, same hub, before the window); else the sweep's one S(d) and the
    window's verify time. S(d) is not one number on a shared CPU: the drafter runs colder with
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


def hub_overhead(cfg: BenchConfig, procs: Processes, work: Path, info: TargetInfo,
                 cpus: tuple[set[int] | None, set[int] | None] = (None, None)) -> dict:  # fmt: skip
    """Null-drafter hub round against a bare ZeroMQ echo process (see scripts/overhead.py).

    With ``cpus`` (hub side, client side) the echo and the hub run where the scale suite's hubs
    run and the client where its emulated targets run, so the round is that suite's link time.
    """
    import overhead

    where = "" if cpus[0] is None else f" (hub on CPU {sorted(cpus[0])}, client on the others)"
    print(f"[overhead] hub round (null drafter) against a bare ZeroMQ echo{where} ...", flush=True)
    echo = procs.start([str(REPO / "scripts" / "zmq_echo.py")], work / "echo.log", cpus=cpus[0])
    echo_ep = wait_for_line(work / "echo.log", r"echo listening on (tcp://\S+)", echo)
    hub, hub_ep = start_hub(procs, cfg.draft, work / "hub-null.log", "--draft-kind", "null",
                            cpus=cpus[0])  # fmt: skip
    hello = Hello(info.model, info.vocab_size, info.tokenizer)
    own = os.sched_getaffinity(0)
    try:
        if cpus[1] is not None:
            os.sched_setaffinity(0, cpus[1])
        result = overhead.measure(echo_ep, hub_ep, hello, rounds=500 if cfg.quick else 2000, reps=5)
        result["round_after_verify_ms"] = overhead.link_round_ms(hub_ep, hello, cfg.verify_ms / 1e3)
        return result
    finally:
        os.sched_setaffinity(0, own)
        stop(hub)
        stop(echo)


# ---------------------------------------------------------------------- report


def markdown(result: dict) -> str:
    """The runs as a short markdown table."""
    lines = ["| mode | N | system tok/s | predicted | per-target tok/s | hub busy | "
             "mean accepted | latency mean/p99/std ms |", "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lat = r["latency_ms"] or {}
        lines.append(
            f"| {_label(r)} | {r['n_targets']} | {r['system_tokens_per_s']:.1f} | "
            f"{_fmt(r['predicted_system_tokens_per_s'])} | {r['per_target_tokens_per_s']:.1f} | "
            f"{_fmt(r['hub_busy_fraction'], 2)} | {_fmt(r['mean_accepted'], 2)} | "
            f"{lat.get('mean', 0):.2f}/{lat.get('p99', 0):.2f}/{lat.get('std', 0):.2f} |"
        )
    return "\n".join(lines)


def _label(record: dict) -> str:
    kind = record.get("draft_kind")
    return f"{record['mode']} ({kind})" if kind and kind != "llm" else record["mode"]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(result: dict, path: Path) -> None:
    """Measured against predicted system throughput (and per-target) per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if result["suite"] == "scale":
        runs = [r for r in runs if r["mode"] == "emulated"]
        ns = [r["n_targets"] for r in runs]
        ax.plot(ns, [r["system_tokens_per_s"] for r in runs], "o-", label="system (measured)")
        ax.plot(ns, [r["predicted_system_tokens_per_s"] for r in runs], "--",
                label="system (model)")  # fmt: skip
        ax.plot(ns, [r["per_target_tokens_per_s"] for r in runs], "s-", label="per target")
        ax.axvline(result["n_full_model"], ls=":", c="red", label="N_full (model)")
        ax.set(xscale="log", xlabel="emulated targets N", ylabel="tokens/s")
    else:
        labels = [f"{_label(r)}\nN={r['n_targets']}" for r in runs]
        ax.bar(labels, [r["system_tokens_per_s"] for r in runs], label="measured")
        pred = [r["predicted_system_tokens_per_s"] or 0 for r in runs]
        ax.scatter(labels, pred, c="red", zorder=3, label="model")
        ax.set(ylabel="system tokens/s")
        ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    ax.set_title(f"StarSD {result['suite']} benchmark")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """argparse -> BenchConfig (--quick shortens every run)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=["main", "scale", "lan"], default="main")
    p.add_argument("--target", default=str(models.DEFAULT_TARGET_DIR))
    p.add_argument("--draft", default=str(models.DEFAULT_DRAFT_DIR))
    p.add_argument("--eagle", default=BenchConfig.eagle, help="EAGLE head for the target")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--gamma", type=int, default=BenchConfig.gamma)
    p.add_argument("--alpha", type=float, default=BenchConfig.alpha)
    p.add_argument("--verify-ms", type=float, default=BenchConfig.verify_ms)
    p.add_argument("--delay-ms", type=float, default=BenchConfig.delay_ms)
    p.add_argument("--rate-mbit", type=float, default=BenchConfig.rate_mbit)
    p.add_argument("--out-dir", default=BenchConfig.out_dir)
    a = vars(p.parse_args(argv))
    if a["quick"]:
        a.update(max_new_tokens=32, ns=(1, 2), duration=2.5, calibration=1.5)
    return BenchConfig(**a)


def suite_lan(cfg: BenchConfig, procs: Processes, work: Path) -> dict:
    """Hub and targets on separate hosts (network namespaces), behind a delaying proxy."""
    import netem

    ok, why = netem.available()
    if not ok:
        print(f"[lan] network namespaces unavailable ({why}): falling back to loopback, "
              "with the same delay proxy", flush=True)  # fmt: skip
        return lan_loopback(cfg, procs, work)
    netem.cleanup_stale()
    runs = []
    with netem.Namespaces(max(cfg.ns)) as net:
        prefix = ["ip", "netns", "exec", net.hub.netns]
        # Plain text inside namespaces this run created and removes: --insecure says so.
        hub, _ = start_hub(procs, cfg.draft, work / "hub-lan.log", "--gamma", str(cfg.gamma),
                           "--insecure", bind=f"tcp://{net.hub.ip}:5555",
                           prefix=prefix)  # fmt: skip
        proxy = netem.ProxyConfig(net.hub.ip, 5555, net.hub.ip, 6000, cfg.delay_ms,
                                  cfg.rate_mbit, spin_ms=0.0)  # fmt: skip
        net.run_in(net.hub, netem.proxy_argv(proxy))
        time.sleep(1.0)
        for n in cfg.ns:
            print(f"[lan] one hub + {n} target host(s), {cfg.delay_ms} ms each way ...", flush=True)
            rows = run_targets(cfg, procs, work, [f"tcp://{net.hub.ip}:6000"] * n, f"lan-{n}",
                               [["ip", "netns", "exec", h.netns] for h in net.targets[:n]])
            runs.append(targets_record("one-for-many", rows, cfg.gamma,
                                       bytes_per_round=proposal_bytes(cfg.gamma)))  # fmt: skip
        stop(hub)
    return {"runs": runs, "network": "namespaces", **_link(cfg)}


def lan_loopback(cfg: BenchConfig, procs: Processes, work: Path) -> dict:
    """The same measurement on loopback, the delay proxy in front of the hub."""
    import netem

    hub, endpoint = start_hub(procs, cfg.draft, work / "hub-lan.log", "--gamma", str(cfg.gamma))
    port = int(endpoint.rsplit(":", 1)[1])
    proxy = netem.DelayProxy(netem.ProxyConfig("127.0.0.1", port, delay_ms=cfg.delay_ms,
                                               rate_mbit=cfg.rate_mbit))  # fmt: skip
    host, proxy_port = proxy.start_background()
    runs = []
    try:
        for n in cfg.ns:
            rows = run_targets(cfg, procs, work, [f"tcp://{host}:{proxy_port}"] * n, f"lan-{n}")
            runs.append(targets_record("one-for-many", rows, cfg.gamma,
                                       bytes_per_round=proposal_bytes(cfg.gamma)))  # fmt: skip
    finally:
        proxy.stop_background()
        stop(hub)
    return {"runs": runs, "network": "loopback", **_link(cfg)}


def _link(cfg: BenchConfig) -> dict:
    return {"link": {"one_way_delay_ms": cfg.delay_ms, "rate_mbit": cfg.rate_mbit}}


SUITES = {"main": suite_main, "scale": suite_scale, "lan": suite_lan}
OUT_NAMES = {"main": "bench", "scale": "bench-scale", "lan": "bench-lan"}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up (processes, namespaces) like Ctrl-C


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    procs = Processes()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="starsd-bench-") as tmp:
        try:
            result = {"suite": cfg.suite, "config": asdict(cfg),
                      **SUITES[cfg.suite](cfg, procs, Path(tmp))}  # fmt: skip
        except KeyboardInterrupt:
            print("bench: interrupted; all processes stopped", file=sys.stderr)
            return 130
        finally:
            procs.stop_all()
    result["wall_s"] = time.perf_counter() - started
    result["machine"] = machine()
    out = REPO / cfg.out_dir / f"{OUT_NAMES[cfg.suite]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print({k: v for k, v in result.items() if k not in ("runs", "config")})
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f} s")
    return 0


def machine() -> dict[str, Any]:
    """Where the figures were measured."""
    import os
    import platform

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor(), "torch": torch.__version__,
            "python": platform.python_version()}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
