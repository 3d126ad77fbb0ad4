"""What the benchmark suites share: configuration, JSON record, hub overhead probe."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import REPO, Processes, start_hub, stop, wait_for_line

from edge.client import TargetInfo
from starsd import models
from starsd.protocol import Hello


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
