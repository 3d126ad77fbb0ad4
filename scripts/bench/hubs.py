"""The hubs suite: one hub against two, and a hub SIGKILLed under real targets.

    python -m scripts.bench.hubs [--quick] [--ns 8 16 32 64] [--max-batch 4]   # make bench-hubs

1. Emulated sweep (scripts/emulate/emulated.py: the real protocol to real hubs, the target's forward
   a wait): at every N, one hub (``--hub A``) and two hubs (``--hub A,B``, every emulated target
   placing its sessions by the hubs' reported load, as a real target does), run back to back with
   the mode that goes first alternating (this machine's speed drifts within minutes), the whole
   sweep ``--repeats`` times; and as a control a static split (two emulator processes, half the
   targets each, each given one hub only), which takes placement and the multi-hub client out of the
   measurement. Hub A is pinned to the first CPU, hub B to the second. The emulator stands in for
   other machines but has no CPU of its own here: with one hub it gets the second CPU (hub B idles
   there), with two hubs (either way) it runs on both CPUs beside them, so its share of the CPUs
   (``emulator_cpu_fraction``) is taken from the two hubs, and the ratio two/one is bounded by about
   2 minus that share. Reported: saturated system throughput per mode (the best tok/s at any N,
   median over repeats), the ratio two/one (target >= 1.8x), and the balance (sessions placed per
   hub, open sessions, jobs, busy fraction per hub).
2. Fault run: two real hubs (``--heartbeat-s``), several real target processes (``--hub A,B``,
   greedy, ``--concurrency``), one hub SIGKILLed once every target holds sessions on it. Every
   output is compared token for token with the target alone (``edge.target --standalone``);
   from the output rows: the sequences that moved, ``resume_s`` (loss detected -> first proposal
   verified on the survivor) against one heartbeat, and ``standalone_after_move``; from the
   targets' logs, the time from the kill to each target detecting it.

Writes results/bench-hubs.json and results/bench-hubs.png. With ``--profile DRAFT.json,TARGET.json``
(``make bench-hubs PROFILE=...``) the sweep's hubs and emulated targets replay that profile pair
and the plan's prediction goes beside every run (scripts/bench/replay.py), into
results/bench-hubs-<pair name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from edge.handshake import TargetInfo
from scripts.bench import replay
from scripts.bench.common import sweep_order
from scripts.bench.harness import (
    PROMPTS,
    REPO,
    Processes,
    run_suite,
    start_hub_set,
    start_hubs,
    stop,
    wait_for_line,
    write_prompts,
)
from scripts.bench.hubs_report import (
    MODES,
    ONE,
    TWO,
    fault_summary,
    markdown,
    plot,
    sweep_summary,
)
from scripts.bench.scale import NO_PREDRAFT, Phases, wait_sessions_closed
from starsd import models


@dataclass(frozen=True)
class HubsConfig:
    """What scripts/bench/hubs.py is told."""

    target: str = str(models.TOY_TARGET_DIR)
    draft: str = str(models.TOY_DRAFT_DIR)
    quick: bool = False
    ns: tuple[int, ...] = (8, 16, 32, 64)
    repeats: int = 2
    max_batch: int = 4  # each hub's --max-batch: saturates at small N (see docs/benchmarks.md)
    gamma: int = 4
    alpha: float = 0.7
    verify_ms: float = 8.0
    duration: float = 4.0
    warmup: float = 1.0
    calibration: float = 1.0
    heartbeat_s: float = 0.5  # both phases' hubs; the fault run's resume target is one of it
    fault_targets: int = 3
    fault_concurrency: int = 4
    fault_prompts: int = 18  # per target (the harness prompts, repeated)
    fault_max_new_tokens: int = 64
    out_dir: str = "results"
    # the sweep replayed under profiles (scripts/bench/replay.py): the hubs draft with
    # --draft-kind emulated at the draft profile's S(B, g), the emulated targets verify and
    # decode alone at the target profile's V(1, g) and T(1) ("": the draft LLM, --verify-ms)
    draft_profile: str = ""
    target_profile: str = ""


# ---------------------------------------------------------------------- placement and order


def cpus() -> tuple[set[int], set[int]]:
    """The CPUs of hubs A and B: the first two this process may use (one CPU: both share it)."""
    mine = sorted(os.sched_getaffinity(0))
    return {mine[0]}, {mine[1 if len(mine) > 1 else 0]}


def emulator_cpus(mode: str, hub_cpus: tuple[set[int], set[int]]) -> set[int]:
    """Where the emulator runs: beside hub A on hub B's CPU with one hub (B idles), on both
    hubs' CPUs with two (it has none of its own on a two-CPU machine)."""
    a, b = hub_cpus
    return set(b) if mode == ONE else a | b


# ---------------------------------------------------------------------- the sweep


def start_emulator(
    cfg: HubsConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    endpoints: list[str],
    n: int,
    cpus_: set[int],
    tag: str,
) -> tuple[Any, Path]:
    """Start one ``scripts/emulate/emulated.py`` run of ``n`` targets over ``endpoints``."""
    out = work / f"emulated-{tag}.json"
    args = [
        "-m",
        "scripts.emulate.emulated",
        "--hub",
        ",".join(endpoints),
        "--vocab-size",
        str(info.vocab_size),
        "--tokenizer",
        info.tokenizer,
        "--targets",
        str(n),
        "--alpha",
        str(cfg.alpha),
        "--verify-ms",
        str(cfg.verify_ms),
        "--gamma",
        str(cfg.gamma),
        "--duration",
        str(cfg.duration),
        "--calibration",
        str(cfg.calibration),
        "--warmup",
        str(cfg.warmup),
        "--seed",
        tag[-1],
        "--out",
        str(out),
        # one driver for one hub and two alike (two need the asyncio one): the modes compared
        # must pay the same load generator
        "--driver",
        "asyncio",
        *(["--profile", cfg.target_profile] if cfg.target_profile else []),
    ]
    return procs.start(args, out.with_suffix(".log"), cpus=cpus_), out


def emulate(
    cfg: HubsConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    groups: list[tuple[list[str], int]],
    cpus_: set[int],
    tag: str,
) -> list[dict]:
    """One emulator process per (endpoints, targets) group, all at once; their reports."""
    running = [
        start_emulator(cfg, procs, work, info, eps, n, cpus_, f"{tag}-{i}")
        for i, (eps, n) in enumerate(groups)
    ]
    for proc, out in running:
        wait_ok(proc, out.with_suffix(".log"), cfg.duration + cfg.calibration + 180)
    return [dict(json.loads(out.read_text())) for _, out in running]


def merged(reports: list[dict]) -> dict:
    """Several emulators' reports as one (the static split: one emulator per hub): throughput
    and CPU summed, busy averaged, each hub's figures side by side."""
    if len(reports) == 1:
        return reports[0]
    total = sum(r["system_tokens_per_s"] for r in reports)
    n = sum(r["n_targets"] for r in reports)
    hubs = [
        {
            "endpoint": r["config"]["hub"],
            "sessions_placed": r["n_targets"],
            "busy_fraction": r["hub_busy_fraction"],
            "tokens_per_s": r["system_tokens_per_s"],
            "jobs": r["hub_jobs"],
            "mean_open_sessions": r["n_targets"],
        }
        for r in reports
    ]
    return {
        **reports[0],
        "system_tokens_per_s": total,
        "per_target_tokens_per_s": total / n,
        "hub_busy_fraction": statistics.mean(r["hub_busy_fraction"] for r in reports),
        "emulator_cpu_fraction": sum(r["emulator_cpu_fraction"] for r in reports),
        "rounds": sum(r["rounds"] for r in reports),
        "hubs": hubs,
    }


def run_record(mode: str, n: int, repeat: int, report: dict) -> dict:
    """One sweep run's record: the emulator's figures that the summary and the plot use."""
    keep = (
        "system_tokens_per_s",
        "per_target_tokens_per_s",
        "hub_busy_fraction",
        "mean_batch_size",
        "queue_wait_ms",
        "acceptance_rate",
        "mean_accepted",
        "latency_ms",
        "proposal_wait_ms",
        "emulator_cpu_fraction",
        "load_generator_ms_per_round",
        "rounds",
        "sequence_errors",
        "hubs",
        "balance",
    )
    return {
        "mode": mode,
        "n_targets": n,
        "repeat": repeat,
        **{k: report[k] for k in keep if k in report},
    }


def mode_groups(mode: str, hubs: dict[str, str], n: int) -> list[tuple[list[str], int]]:
    """The emulator processes of a mode: (hubs each target may use, targets)."""
    if mode == ONE:
        return [([hubs["a"]], n)]
    if mode == TWO:
        return [([hubs["a"], hubs["b"]], n)]
    return [([hubs["a"]], n - n // 2), ([hubs["b"]], n // 2)]


def run_sweep(
    cfg: HubsConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    hubs: dict[str, str],
    hub_cpus: tuple[set[int], set[int]],
) -> list[dict]:
    """Every (repeat, N, mode) of :func:`~scripts.bench.common.sweep_order`; one record each."""
    runs = []
    for repeat, n, mode in sweep_order(cfg.ns, MODES, cfg.repeats):
        started, groups = time.perf_counter(), mode_groups(mode, hubs, n)
        reports = emulate(
            cfg, procs, work, info, groups, emulator_cpus(mode, hub_cpus), f"{mode}-{n}-{repeat}"
        )
        for endpoint in {ep for eps, _ in groups for ep in eps}:  # the next run: empty hubs
            wait_sessions_closed(endpoint, info)
        runs.append(run_record(mode, n, repeat, merged(reports)))
        print(
            f"[hubs] {mode}, N={n} (repeat {repeat}): {progress(runs[-1])} "
            f"({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    return runs


def progress(run: dict) -> str:
    """One sweep run in a line: throughput, busy, emulator CPU, and with two hubs the split."""
    line = (
        f"{run['system_tokens_per_s']:.0f} tok/s, busy {run['hub_busy_fraction']:.2f}, "
        f"emulator CPU {run['emulator_cpu_fraction']:.2f}"
    )
    if "hubs" in run:
        placed = "/".join(str(h["sessions_placed"]) for h in run["hubs"])
        busy = "/".join(f"{h['busy_fraction']:.2f}" for h in run["hubs"])
        line += f"; sessions placed {placed}, busy {busy}"
    return line


# ---------------------------------------------------------------------- the fault run


def target_args(
    cfg: HubsConfig, hub: str | None, prompts: Path, out: Path, concurrency: int
) -> list[str]:
    """``python -m edge.target`` on ``prompts``, greedy; ``hub`` None: ``--standalone``."""
    source = ["--standalone"] if hub is None else ["--hub", hub]
    return [
        "-m",
        "edge.target",
        *source,
        "--model",
        cfg.target,
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        str(cfg.fault_max_new_tokens),
        "--concurrency",
        str(concurrency),
    ]


def read_rows(out: Path) -> list[dict]:
    """edge.target's JSONL output."""
    return [json.loads(line) for line in out.read_text().splitlines()]


def wait_ok(proc: Any, log: Path, timeout: float = 600) -> None:
    """Wait for a child; raise with its log's tail if it failed."""
    if proc.wait(timeout=timeout) != 0:
        raise RuntimeError(f"{proc.args} failed:\n{log.read_text()[-3000:]}")


def start_reference(cfg: HubsConfig, procs: Processes, work: Path) -> tuple[Any, Path]:
    """The target alone on the fault run's prompts (started early: it needs no hub)."""
    prompts = work / "fault-prompts.jsonl"
    write_prompts(prompts, [PROMPTS[i % len(PROMPTS)] for i in range(cfg.fault_prompts)])
    out = work / "standalone.jsonl"
    proc = procs.start(target_args(cfg, None, prompts, out, 1), out.with_suffix(".log"))
    return proc, out


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.MULTILINE)


def detected_at(log: str, endpoint: str) -> float | None:
    """When a target's log first says the hub at ``endpoint`` is unavailable (epoch seconds)."""
    for line in log.splitlines():
        if f"hub {endpoint} unavailable" in line:
            stamp = _LOG_TIME.match(line)
            if stamp:
                return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def run_fault(cfg: HubsConfig, procs: Processes, work: Path) -> dict:
    """Two hubs, ``fault_targets`` targets over both; hub A SIGKILLed once it serves them all."""
    hb = ["--heartbeat-s", str(cfg.heartbeat_s), "--stats-interval", "0.5"]
    (victim, victim_ep), (survivor, survivor_ep) = start_hubs(
        procs, cfg.draft, [work / "fault-hub-a.log", work / "fault-hub-b.log"], *hb
    )
    prompts = work / "fault-prompts.jsonl"
    targets = []
    for i in range(cfg.fault_targets):
        out = work / f"fault-target-{i}.jsonl"
        args = target_args(cfg, f"{victim_ep},{survivor_ep}", prompts, out, cfg.fault_concurrency)
        targets.append((procs.start(args, out.with_suffix(".log")), out))
    pattern = rf"hub: targets={cfg.fault_targets} sessions=([1-9]\d*)"
    sessions = wait_for_line(work / "fault-hub-a.log", pattern, victim, timeout=120)
    killed = time.time()
    victim.send_signal(signal.SIGKILL)
    print(
        f"[fault] hub A SIGKILLed holding {sessions} sessions of {cfg.fault_targets} targets",
        flush=True,
    )
    for proc, out in targets:
        wait_ok(proc, out.with_suffix(".log"))
    stop(survivor)
    logs = [out.with_suffix(".log").read_text() for _, out in targets]
    detected = [detected_at(log, victim_ep) for log in logs]
    return {
        "killed_holding_sessions": int(sessions),
        "rows": [read_rows(o) for _, o in targets],
        "detection_s": [None if d is None else round(d - killed, 3) for d in detected],
    }


# ---------------------------------------------------------------------- the suite


def sweep_hubs(
    cfg: HubsConfig, work: Path, hub_cpus: tuple[set[int], set[int]]
) -> dict[str, tuple[Path, list[str], set[int] | None]]:
    """The sweep's two hubs, identical but for their CPU."""
    args = [
        "--model",
        cfg.draft,
        "--max-sessions",
        "4096",
        "--gamma",
        str(cfg.gamma),
        "--max-batch",
        str(cfg.max_batch),
        "--heartbeat-s",
        str(cfg.heartbeat_s),
        *NO_PREDRAFT,
        *(
            ["--draft-kind", "emulated", "--draft-profile", cfg.draft_profile]
            if cfg.draft_profile
            else []
        ),
    ]
    return {
        name: (work / f"hub-{name}.log", args, c) for name, c in zip("ab", hub_cpus, strict=True)
    }


def suite(cfg: HubsConfig, procs: Processes, work: Path) -> dict[str, Any]:
    """Both phases; the JSON's body."""
    target = models.load_tokenizer_info(cfg.target)
    info = TargetInfo("bench-hubs", target.vocab_size, target.tokenizer_fingerprint)
    phases, hub_cpus = Phases(), cpus()
    with phases("hubs_start"):  # the reference decodes while the hubs load
        reference = start_reference(cfg, procs, work)
        started = start_hub_set(procs, sweep_hubs(cfg, work, hub_cpus))
        wait_ok(reference[0], reference[1].with_suffix(".log"))
    hubs = {name: endpoint for name, (_, endpoint) in started.items()}
    with phases("sweep"):
        runs = run_sweep(cfg, procs, work, info, hubs, hub_cpus)
    for proc, _ in started.values():
        stop(proc)
    with phases("fault"):
        fault = run_fault(cfg, procs, work)
    summary = fault_summary(
        fault["rows"], read_rows(reference[1]), cfg.heartbeat_s, fault["detection_s"]
    )
    return {
        "runs": runs,
        "sweep": sweep_summary(runs),
        "fault": {**summary, "killed_holding_sessions": fault["killed_holding_sessions"]},
        "placement": placement_note(hub_cpus),
        "phase_s": phases.seconds,
    }


def placement_note(hub_cpus: tuple[set[int], set[int]]) -> dict[str, Any]:
    """What ran where (the JSON says it, so nobody has to guess)."""
    return {
        "hub_a": sorted(hub_cpus[0]),
        "hub_b": sorted(hub_cpus[1]),
        "emulator": {m: sorted(emulator_cpus(m, hub_cpus)) for m in MODES},
        "fault_run": "hubs, targets and the standalone reference unpinned",
    }


# ---------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> HubsConfig:
    """argparse -> HubsConfig (--quick: one repeat, shorter windows)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=HubsConfig.target)
    p.add_argument("--draft", default=HubsConfig.draft)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ns", type=int, nargs="+", default=list(HubsConfig.ns))
    p.add_argument("--repeats", type=int, default=None, help="sweeps (default 2, --quick 1)")
    p.add_argument("--max-batch", type=int, default=HubsConfig.max_batch)
    p.add_argument("--verify-ms", type=float, default=HubsConfig.verify_ms)
    p.add_argument("--heartbeat-s", type=float, default=HubsConfig.heartbeat_s)
    p.add_argument("--fault-targets", type=int, default=HubsConfig.fault_targets)
    p.add_argument("--out-dir", default=HubsConfig.out_dir)
    p.add_argument("--draft-profile", default="", help="the hubs replay this draft profile")
    p.add_argument("--target-profile", default="", help="the emulated targets follow this one")
    replay.add_profile_option(p)
    a = vars(p.parse_args(argv))
    replay.resolve_profiles(p, a)
    a["ns"] = tuple(a["ns"])
    quick = {"duration": 2.0, "warmup": 0.5, "calibration": 1.0} if a["quick"] else {}
    a["repeats"] = a["repeats"] or (1 if a["quick"] else HubsConfig.repeats)
    return HubsConfig(**a, **quick)


def main(argv: list[str] | None = None) -> int:
    """Run the suite; write results/bench-hubs.json and .png; print the table."""
    cfg = parse_args(argv)
    result = run_suite(
        "bench-hubs",
        lambda procs, work: {"suite": "hubs", "config": asdict(cfg), **suite(cfg, procs, work)},
    )
    if result is None:
        return 130
    out = (
        REPO
        / cfg.out_dir
        / f"{replay.out_stem('bench-hubs', cfg.draft_profile, cfg.target_profile)}.json"
    )
    result["plan_check"] = replay.hubs_check(result, cfg, out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    if result["plan_check"]:
        print(replay.report(result["runs"], result["plan_check"]))
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
