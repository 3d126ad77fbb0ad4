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
from collections.abc import Iterator, Sequence
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
    null_hub_figures,
    run_record,
    sweep_order,
)
from scripts.bench.harness import Processes, rss_mb, start_hub_set, start_hubs, stop
from scripts.bench.scale_report import (
    BATCHED,
    HUBS,
    ONE_AT_A_TIME,
    batched_inputs,
    compare_hubs,
    curve_points,
    emulated_record,
    hub_summary,
    latency_steadiness,
    pooled_points,
    sweep_inputs,
)
from starsd import analytic, models, transport
from starsd.stats import latency_summary

AUTO_HUB = "auto"  # the batched hub under --gamma auto (fixed gammas run on "batched")
TREES_ON_HUB = "trees-on"  # the auto hub under --tree on (the tree comparison's)
QUICK_OVERHEAD_ROUNDS = 300
# The emulated targets append random tokens, so a pre-drafted branch (a guess at the verdict)
# would never be used: pre-drafting would only take the hubs' CPU while they idle. Off, so the
# sweep measures batching alone.
NO_PREDRAFT = ("--predraft-branches", "0")


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
    and the message path (on the hubs' CPU), then the two swept hubs, which differ only in
    --max-batch, and the batched hub under --gamma auto (the gamma comparison's; the fixed
    gammas run on the swept batched hub, which keeps the gamma an OPEN names)."""
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
    with phases("link"):  # (and the hub's message path, on the same null hub)
        link_ms, rounds_per_s = null_hub_figures(cfg, procs, work, info, cpus, hubs["null-pinned"])
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
        if not name.startswith("null"):  # (those were stopped after their probes)
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
        "hub_rounds_per_s": rounds_per_s,  # its message path (a null hub flooded)
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
