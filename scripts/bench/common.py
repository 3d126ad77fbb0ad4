"""What the benchmark suites share: configuration, JSON record, run order, hub overhead probe."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from edge.client import HubClient
from edge.handshake import TargetInfo
from scripts.bench.harness import Processes, start_hub, stop, wait_for_line
from scripts.bench.pinning import pinned
from starsd import models, transport
from starsd.protocol import Hello, Stats


@dataclass(frozen=True)
class BenchConfig:
    """What scripts/bench/run.py is told."""

    suite: str
    target: str
    draft: str
    eagle: str = str(models.TOY_TARGET_DIR.parent / "starsd-eagle")
    quick: bool = False
    gamma: int = 4
    max_new_tokens: int = 64
    ns: tuple[int, ...] = (1, 2, 3)
    scale_ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    max_batch: int = 64  # the batched hub's --max-batch (the baseline hub runs with 1)
    alpha: float = 0.7
    verify_ms: float = 8.0
    # scale suite, fixed vs auto gamma: the emulated target's verify of g tokens takes
    # auto_verify_ms + g * auto_verify_per_token_ms, a token decoded alone auto_verify_ms
    auto_verify_ms: float = 16.0
    auto_verify_per_token_ms: float = 1.5
    duration: float = 4.0
    warmup: float = 1.0  # emulated runs: at least this long before the first slice
    calibration: float = 2.0  # emulated runs: seconds of calibration slices around the window
    delay_ms: float = 1.0
    rate_mbit: float = 1000.0
    out_dir: str = "results"
    # scale suite, replayed under profiles (starsd profile): the swept hubs draft with
    # --draft-kind emulated at this draft profile's S(B, g), the emulated targets verify at this
    # target profile's V(1, g) and decode alone at its T(1) ("": the real drafter, --verify-ms)
    draft_profile: str = ""
    target_profile: str = ""
    # scale suite, the real drafter (no replayed pair): the plan of the sweep reads the swept
    # drafter's S(B, g) from this draft profile (starsd profile draft of --draft on this
    # machine) and the emulated targets' costs from --verify-ms ("": no plan check)
    plan_draft_profile: str = ""


def run_record(mode: str, n: int, **fields: Any) -> dict[str, Any]:
    """One ``runs`` record with every key of the JSON contract present."""
    base: dict[str, Any] = {
        "mode": mode,
        "n_targets": n,
        "system_tokens_per_s": None,
        "per_target_tokens_per_s": None,
        "predicted_system_tokens_per_s": None,
        "hub_busy_fraction": None,
        "acceptance_rate": None,
        "mean_accepted": None,
        "latency_ms": None,
        "bytes_per_round": None,
        "queue_wait_ms": None,
    }
    base.update(fields)
    return base


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


Hub = tuple[subprocess.Popen[bytes], str]  # a started hub process and its endpoint
# No message budget: the probes send PINGs and rounds back to back, as no target does.
T = TypeVar("T")


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` rotated left by ``k`` places (modulo their number)."""
    k %= len(items)
    return [*items[k:], *items[:k]]


def sweep_order(
    ns: Sequence[int], modes: Sequence[T], repeats: int = 1
) -> list[tuple[int, int, T]]:
    """(repeat, N, mode) in run order: every mode at every N back to back, the mode that goes
    first rotating by one from one N to the next (and on from one repeat to the next)."""
    order = []
    for repeat in range(repeats):
        for i, n in enumerate(ns):
            order += [(repeat, n, m) for m in rotated(modes, repeat * len(ns) + i)]
    return order


NULL_HUB_ARGS = ("--draft-kind", "null", "--peer-budget", "0")


def hub_overhead(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    rounds: int | None = None,
    hub: Hub | None = None,
) -> dict:
    """Null-drafter hub round against a bare ZeroMQ echo process (see scripts/bench/overhead.py);
    ``rounds`` per probe (default 3000, 1000 with --quick); ``hub``: a null hub already
    started (unpinned, NULL_HUB_ARGS), stopped here."""
    from scripts.bench import overhead

    print("[overhead] hub round (null drafter) against a bare ZeroMQ echo ...", flush=True)
    echo = procs.start(["-m", "scripts.emulate.zmq_echo"], work / "echo.log")
    echo_ep = wait_for_line(work / "echo.log", r"echo listening on (tcp://\S+)", echo)
    proc, hub_ep = hub or _null_hub(cfg, procs, work, None)
    try:
        result = overhead.measure(
            echo_ep, hub_ep, _hello(info), rounds or (1000 if cfg.quick else 3000)
        )
    finally:
        stop(proc)
        stop(echo)
    blocking, echo_ms = result["blocking_client"], result["echo_round_trip_ms"]
    print(
        f"[overhead] paced ({result['think_ms']} ms idle): echo {echo_ms:.3f}"
        f" ms, round {result['round_ms']:.3f} ms, hub adds {result['added_over_echo']:.2f}x the"
        f" echo (blocking client {blocking['added_over_echo']:.2f}x); back to back"
        f" {result['back_to_back']['added_over_echo']:.2f}x"
        f" ({blocking['back_to_back']['added_over_echo']:.2f}x)",
        flush=True,
    )
    return result


# The flood that measures a hub's message path: sessions in flight (enough to keep the hub's
# Python threads busy: the rate is flat from 64 on, results/hub-flood.json) and seconds counted
FLOOD_SESSIONS = 64
FLOOD_SECONDS = 2.0


def null_hub_figures(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    cpus: tuple[set[int] | None, set[int] | None],
    hub: Hub | None = None,
) -> tuple[float, float]:
    """Two figures of one null hub on ``cpus[0]``, the client on ``cpus[1]`` (None: anywhere):
    the model's link time in ms (a null-drafter round after the client idled the verify time)
    and the rounds a second its message path carries (flooded by FLOOD_SESSIONS sessions,
    :mod:`scripts.bench.hub_flood`: the plan's ``hub_rounds_per_s``). ``hub``: a null hub
    already started so (NULL_HUB_ARGS), stopped here."""
    from scripts.bench import hub_flood, overhead

    proc, hub_ep = hub or _null_hub(cfg, procs, work, cpus[0])
    hello = _hello(info)
    try:
        with pinned(cpus[1]):
            print("[overhead] null-drafter round after an idle verify time ...", flush=True)
            link_ms = overhead.link_round_ms(hub_ep, hello, cfg.verify_ms / 1e3)
            print(f"[overhead] the null hub flooded by {FLOOD_SESSIONS} sessions ...", flush=True)
            rounds = hub_flood.rounds_per_s(hub_ep, hello, FLOOD_SESSIONS, FLOOD_SECONDS)
    finally:
        stop(proc)
    return link_ms, rounds


def _null_hub(cfg: BenchConfig, procs: Processes, work: Path, cpus: set[int] | None) -> Hub:
    return start_hub(procs, cfg.draft, work / "hub-null.log", *NULL_HUB_ARGS, cpus=cpus)


def _hello(info: TargetInfo) -> Hello:
    return Hello(info.model, info.vocab_size, info.tokenizer)


# ---------------------------------------------------------------------- the hub's log

# A hub run for the benchmarks logs its stats lines this often (seconds): a line follows every
# target's last job within one interval, while the target's lease (3 heartbeats) still keeps it
# listed, so the last line that names a target holds its final counters.
STATS_INTERVAL_S = 0.5
_TARGET_LINE = re.compile(r" target (\S+): (sessions=.*)$", re.MULTILINE)
_CONNECTED = re.compile(r" target (\S+) connected ")
_HUB_LINE = re.compile(r" hub: (targets=.*)$", re.MULTILINE)
_FIELD = re.compile(r"(\w+)=(-?[\d.]+)\b")


def _fields(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in _FIELD.findall(text)}


def target_lines(log: str) -> dict[str, dict[str, float]]:
    """Each target's figures from the last stats line that names it (``name -> field -> value``;
    see ``starsd.stats.TargetStats.line``: ``predraft_hits`` is its hit rate, ``queue_wait_ms``
    its mean queue wait)."""
    return {name: _fields(rest) for name, rest in _TARGET_LINE.findall(log)}


def connected_targets(log: str) -> list[str]:
    """The targets that connected, in order (``target NAME connected`` lines)."""
    return _CONNECTED.findall(log)


def hub_line(log: str) -> dict[str, float]:
    """The hub-wide figures of the last ``hub:`` stats line ({} before the first)."""
    lines = _HUB_LINE.findall(log)
    return _fields(lines[-1]) if lines else {}


def pooled_targets(lines: dict[str, dict[str, float]], names: list[str]) -> dict[str, float]:
    """Figures of ``names`` pooled, each target weighted by its rounds (plus its rounds alone):
    hit rate, taken rate (pushed branches), queue wait, acceptance, mean gamma; ``targets``
    counts those with a line."""
    rows = [lines[n] for n in names if n in lines]
    weights = [r.get("rounds", 0) / max(1e-9, 1 - r.get("gamma0", 0)) for r in rows]
    total = sum(weights)
    out: dict[str, float] = {"targets": len(rows), "rounds": sum(r.get("rounds", 0) for r in rows)}
    for key, name in (
        ("predraft_hits", "hit_rate"),
        ("taken", "taken_rate"),
        ("queue_wait_ms", "queue_wait_ms"),
        ("acceptance", "acceptance"),
        ("gamma", "mean_gamma"),
        ("gamma0", "alone_fraction"),
        ("mean_accepted", "mean_accepted"),
    ):
        values = [(r.get(key), w) for r, w in zip(rows, weights, strict=True)]
        out[name] = (sum(v * w for v, w in values if v is not None) / total) if total else 0.0
    return out
