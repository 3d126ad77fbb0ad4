"""Emulated targets: the real protocol to the real hub, with the target forward replaced.

    python scripts/emulated.py --hub tcp://HOST:5555 --model TARGET_DIR --targets 64 \
        --alpha 0.7 --verify-ms 5 --duration 5 --out emulated.json

Each emulated target is its own DEALER connection with one sequence in flight. Instead of a
target forward it waits ``--verify-ms`` (without blocking the loop) and draws the number of
accepted tokens from an i.i.d. acceptance process with rate ``--alpha`` (seeded), so one process
can stand in for far more targets than the machine could run as real models. The hub drafts for
real. The report carries system and per-target throughput, per-token latency, bytes per round,
each round's wait for its proposal (DRAFT sent to PROPOSAL received: the hub's queue wait and
service plus the link), and from STATS replies over the measured window the hub's busy fraction,
mean batch size and, when the hub counts them, its service time per batch size S(B).

After the warm-up, calibration slices alternate with the measured window's slices (so this
machine's drifting speed hits both alike): the hub's draft service time S(d) and the emulated
verify time measured in the calibration slices, at the same N but outside the window, are the
inputs from which the benchmark predicts the window's throughput (scripts/bench_scale.py).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from edge.client import HubClient, TargetInfo
from starsd import protocol, transport
from starsd.protocol import Proposal, SamplingParams, Stats
from starsd.stats import latency_summary

PROMPT_TOKENS = 16
WARMUP_LIMIT_S = 60.0
CLOSE_FLUSH_S = 0.2


@dataclass(frozen=True)
class EmulationConfig:
    """What ``python scripts/emulated.py`` is told."""

    hub: str
    targets: int = 8
    alpha: float = 0.7
    verify_ms: float = 5.0
    gamma: int = 4
    duration: float = 5.0
    warmup: float = 1.0  # at least; and until every target has had its first proposal
    calibration: float = 1.0
    slices: int = 4  # window slices, alternating with slices + 1 calibration slices
    max_new_tokens: int = 128  # then the sequence closes and a new one opens
    seed: int = 0
    model: str = ""  # whose tokenizer the targets claim (default: the default target)
    vocab_size: int = 0  # with ``tokenizer``: claim these instead of reading ``model``
    tokenizer: str = ""
    out: str | None = None


@dataclass
class Phases:
    """The measurement schedule (perf_counter times); empty until the warm-up is over.

    ``bounds`` cut the run after the warm-up into slices that alternate calibration, window,
    calibration, ..., calibration, so that this machine's drifting speed hits the inputs and
    the measurement alike. ``first_proposals`` counts the targets that have had their first
    proposal, so the warm-up can wait out the burst of OPENs.
    """

    bounds: list[float] = field(default_factory=list)
    first_proposals: int = 0

    @property
    def finish(self) -> float:
        """When the targets stop (the end of the last calibration slice)."""
        return self.bounds[-1] if self.bounds else math.inf

    def kind(self, t: float) -> str | None:
        """``"window"``, ``"calibration"`` or None (warm-up, or after the end) at time ``t``."""
        i = bisect.bisect_right(self.bounds, t) - 1
        if i < 0 or i >= len(self.bounds) - 1:
            return None
        return "window" if i % 2 else "calibration"


def schedule(start: float, cfg: EmulationConfig) -> list[float]:
    """Bounds of ``cfg.slices`` window slices between ``cfg.slices + 1`` calibration slices."""
    bounds, t = [start], start
    for i in range(2 * cfg.slices + 1):
        t += cfg.duration / cfg.slices if i % 2 else cfg.calibration / (cfg.slices + 1)
        bounds.append(t)
    return bounds


@dataclass
class TargetRecord:
    """What one emulated target measured inside the window (and in the calibration slices)."""

    tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    bytes: int = 0
    round_s: float = 0.0
    verify_s: float = 0.0
    token_latency_s: list[float] = field(default_factory=list)
    proposal_wait_s: list[float] = field(default_factory=list)  # DRAFT sent -> PROPOSAL in
    had_proposal: bool = False
    calibration_rounds: int = 0
    calibration_verify_s: float = 0.0


def accepted_count(rng: random.Random, alpha: float, gamma: int) -> int:
    """Accepted drafts of one round when each is accepted with probability alpha, in order."""
    n = 0
    while n < gamma and rng.random() < alpha:
        n += 1
    return n


async def run_target(
    client: HubClient, cfg: EmulationConfig, index: int, phases: Phases, record: TargetRecord,
) -> None:  # fmt: skip
    """One emulated target: sequences back to back until the last slice ends."""
    rng = random.Random(cfg.seed * 100_003 + index)
    vocab = client.info.vocab_size
    while time.perf_counter() < phases.finish:
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
        tag, inbox = await client.open(prompt, SamplingParams(), cfg.gamma)
        await _one_sequence(client, cfg, rng, tag, inbox, phases, record)
        await client.close_session(tag)


async def _one_sequence(
    client: HubClient, cfg: EmulationConfig, rng: random.Random, tag: bytes,
    inbox: asyncio.Queue[protocol.Message], phases: Phases, record: TargetRecord,
) -> None:  # fmt: skip
    seq, generated, asked = 0, 0, time.perf_counter()
    while generated < cfg.max_new_tokens and time.perf_counter() < phases.finish:
        msg = await _next_message(inbox, phases)
        if msg is None:  # the run ended while the hub was still drafting it: stop waiting
            return
        verify_started = time.perf_counter()
        if not isinstance(msg, Proposal):
            raise RuntimeError(f"hub: {msg}")
        if not record.had_proposal:
            record.had_proposal = True
            phases.first_proposals += 1
        await asyncio.sleep(cfg.verify_ms / 1e3)
        accepted = accepted_count(rng, cfg.alpha, len(msg.tokens))
        now = time.perf_counter()
        kind = phases.kind(now)  # by when the round ends; rounds after the end do not count
        if kind == "window":
            _record_round(record, msg, accepted, now - asked)
            record.verify_s += now - verify_started  # the timer overshoots the nominal time
            if seq > 0:  # after a DRAFT (the first proposal answers the OPEN, prefill included)
                record.proposal_wait_s.append(verify_started - asked)
        elif kind == "calibration":
            record.calibration_rounds += 1
            record.calibration_verify_s += now - verify_started
        generated += accepted + 1
        seq += 1
        asked = time.perf_counter()
        await client.draft(tag, seq, accepted, [rng.randrange(client.info.vocab_size)])


async def _next_message(inbox: asyncio.Queue[protocol.Message], phases: Phases
                        ) -> protocol.Message | None:  # fmt: skip
    """The session's next message, or None once the last slice has ended (the caller then
    closes the session, so the hub drops its queued job instead of drafting it into the next
    run)."""
    if math.isinf(phases.finish):  # warm-up: the schedule is not set yet
        return await inbox.get()
    try:
        return await asyncio.wait_for(inbox.get(), max(0.0, phases.finish - time.perf_counter()))
    except asyncio.TimeoutError:
        return None


def _record_round(record: TargetRecord, msg: Proposal, accepted: int, round_s: float) -> None:
    tokens = accepted + 1
    record.rounds += 1
    record.tokens += tokens
    record.accepted += accepted
    record.round_s += round_s
    record.bytes += sum(len(bytes(f)) for f in protocol.encode(msg)) + 64  # + the DRAFT
    record.token_latency_s.extend([round_s / tokens] * tokens)


async def emulate(cfg: EmulationConfig) -> dict:
    """Run the emulation and return its report (also written to ``cfg.out``)."""
    ctx = transport.new_context()
    clients = [HubClient(ctx, cfg.hub, target_info(cfg)) for _ in range(cfg.targets)]
    try:
        await asyncio.gather(*(c.connect() for c in clients))
        phases, records = Phases(), [TargetRecord() for _ in clients]
        tasks = [asyncio.create_task(run_target(c, cfg, i, phases, records[i]))
                 for i, c in enumerate(clients)]  # fmt: skip
        await _warm_up(cfg, phases, tasks)
        snapshots, cpu = [], []
        for bound in phases.bounds:
            await asyncio.sleep(max(0.0, bound - time.perf_counter()))
            snapshots.append(await clients[0].stats())
            cpu.append((time.perf_counter(), time.process_time()))
        await asyncio.gather(*tasks)
        await asyncio.sleep(CLOSE_FLUSH_S)  # the sockets close with linger 0: let CLOSEs out
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
        ctx.term()
    spans = list(itertools.pairwise(snapshots))
    (wall0, cpu0), (wall1, cpu1) = cpu[0], cpu[-1]
    return {**report(cfg, records, spans[1::2]),
            "calibration": calibration_report(records, spans[::2]),
            # near 1: this process is the bottleneck, not the hub (split the targets)
            "emulator_cpu_fraction": (cpu1 - cpu0) / (wall1 - wall0)}


def target_info(cfg: EmulationConfig) -> TargetInfo:
    """What the emulated targets claim in HELLO: given, or read from the model directory."""
    if cfg.vocab_size and cfg.tokenizer:
        return TargetInfo("emulated", cfg.vocab_size, cfg.tokenizer)
    from starsd import models  # torch and transformers: seconds, only when asked to read

    info = models.load_tokenizer_info(cfg.model or models.DEFAULT_TARGET_DIR)
    return TargetInfo("emulated", info.vocab_size, info.tokenizer_fingerprint)


async def _warm_up(cfg: EmulationConfig, phases: Phases, tasks: list[asyncio.Task]) -> None:
    """Wait ``cfg.warmup`` and until every target has had a proposal, then set the phases."""
    started = time.perf_counter()
    while phases.first_proposals < cfg.targets or time.perf_counter() - started < cfg.warmup:
        failed = next((t for t in tasks if t.done()), None)
        if failed is not None:
            failed.result()  # its error; a target never ends before the window does
        if time.perf_counter() - started > cfg.warmup + WARMUP_LIMIT_S:
            raise RuntimeError(f"{phases.first_proposals} of {cfg.targets} targets had a "
                               f"proposal after {WARMUP_LIMIT_S:.0f} s")  # fmt: skip
        await asyncio.sleep(0.01)
    phases.bounds = schedule(time.perf_counter(), cfg)


Span = tuple[Stats, Stats]


def hub_counters(spans: list[Span]) -> dict[str, float]:
    """The hub's counters summed over ``spans`` (STATS snapshots at each one's start and end)."""
    return {name: sum(getattr(end, name) - getattr(begin, name) for begin, end in spans)
            for name in ("wall_s", "busy_s", "jobs", "batches", "queue_wait_s")}  # fmt: skip


def per_size_counters(stats: Stats) -> dict[int, tuple[int, float]] | None:
    """batch size -> (batches, summed service seconds) since the hub started, or None from a
    hub whose STATS do not carry the service curve."""
    if stats.batch_sizes is None:
        return None
    return {b: (count, seconds) for b, count, seconds in stats.service_totals()}


def service_curve(spans: list[Span]) -> list[dict] | None:
    """S(B) over ``spans``: one row per batch size the hub drafted (its batches and mean service
    time), or None when the hub does not count batch sizes."""
    totals: dict[int, list[float]] = {}
    for begin, end in spans:
        before, after = per_size_counters(begin), per_size_counters(end)
        if before is None or after is None:
            return None
        for size, (count, seconds) in after.items():
            count0, seconds0 = before.get(size, (0, 0.0))
            if count > count0:
                row = totals.setdefault(size, [0, 0.0])
                row[0] += count - count0
                row[1] += seconds - seconds0
    return [{"batch": b, "batches": int(c), "service_ms": 1e3 * s / c}
            for b, (c, s) in sorted(totals.items())]  # fmt: skip


def _batch_fields(hub: dict[str, float], spans: list[Span]) -> dict:
    batches = hub["batches"]
    return {"hub_batches": batches,
            "mean_batch_size": hub["jobs"] / batches if batches else None,
            "batch_service_ms": 1e3 * hub["busy_s"] / batches if batches else None,
            "service_curve": service_curve(spans)}  # fmt: skip


def calibration_report(records: list[TargetRecord], spans: list[Span]) -> dict:
    """S(d), the batch sizes and the verify time over the calibration slices."""
    hub = hub_counters(spans)
    rounds = sum(r.calibration_rounds for r in records)
    verify_s = sum(r.calibration_verify_s for r in records)
    return {
        "jobs": hub["jobs"],
        "draft_service_s": hub["busy_s"] / hub["jobs"] if hub["jobs"] else None,
        "verify_ms": 1e3 * verify_s / rounds if rounds else None,
        **_batch_fields(hub, spans),
    }


def report(cfg: EmulationConfig, records: list[TargetRecord], spans: list[Span]) -> dict:
    """Aggregate the per-target records and the hub's counters over the window slices."""
    latencies = sorted(x for r in records for x in r.token_latency_s)
    tokens = sum(r.tokens for r in records)
    rounds = sum(r.rounds for r in records)
    hub = hub_counters(spans)
    wall, jobs = hub["wall_s"], max(hub["jobs"], 1)
    return {
        "config": asdict(cfg),
        "n_targets": cfg.targets,
        "system_tokens_per_s": tokens / cfg.duration,
        "per_target_tokens_per_s": tokens / cfg.duration / cfg.targets,
        "hub_busy_fraction": hub["busy_s"] / wall if wall > 0 else 0.0,
        "draft_service_s": hub["busy_s"] / jobs,
        "hub_busy_s": hub["busy_s"],
        "hub_jobs": hub["jobs"],
        "queue_wait_ms": 1e3 * hub["queue_wait_s"] / jobs,
        "acceptance_rate": sum(r.accepted for r in records) / max(rounds * cfg.gamma, 1),
        "mean_accepted": sum(r.accepted for r in records) / max(rounds, 1),
        "bytes_per_round": sum(r.bytes for r in records) / max(rounds, 1),
        "rounds": rounds,
        "tokens_in_window": tokens,
        "round_ms": 1e3 * sum(r.round_s for r in records) / max(rounds, 1),
        "verify_ms": 1e3 * sum(r.verify_s for r in records) / max(rounds, 1),
        "latency_ms": latency_summary(latencies),
        "proposal_wait_ms": latency_summary([x for r in records for x in r.proposal_wait_s]),
        **_batch_fields(hub, spans),
        "token_latency_ms": [round(1e3 * x, 4) for x in latencies],  # for pooling across runs
    }


def parse_args(argv: list[str] | None = None) -> EmulationConfig:
    """argparse -> EmulationConfig."""
    p = argparse.ArgumentParser(prog="scripts/emulated.py", description=__doc__.split("\n")[0])
    p.add_argument("--hub", required=True)
    p.add_argument("--targets", type=int, default=EmulationConfig.targets)
    p.add_argument("--alpha", type=float, default=EmulationConfig.alpha)
    p.add_argument("--verify-ms", type=float, default=EmulationConfig.verify_ms)
    p.add_argument("--gamma", type=int, default=EmulationConfig.gamma)
    p.add_argument("--duration", type=float, default=EmulationConfig.duration)
    p.add_argument("--warmup", type=float, default=EmulationConfig.warmup)
    p.add_argument("--calibration", type=float, default=EmulationConfig.calibration,
                   help="seconds (in all) in which S(d) and verify time are measured")
    p.add_argument("--slices", type=int, default=EmulationConfig.slices,
                   help="window slices, alternating with slices + 1 calibration slices")
    p.add_argument("--max-new-tokens", type=int, default=EmulationConfig.max_new_tokens)
    p.add_argument("--seed", type=int, default=EmulationConfig.seed)
    p.add_argument("--model", default=EmulationConfig.model, help="target dir (tokenizer only)")
    p.add_argument("--vocab-size", type=int, default=EmulationConfig.vocab_size)
    p.add_argument("--tokenizer", default=EmulationConfig.tokenizer,
                   help="tokenizer fingerprint; with --vocab-size, --model is not read")
    p.add_argument("--out")
    return EmulationConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python scripts/emulated.py``."""
    cfg = parse_args(argv)
    result = transport.run_loop(emulate(cfg))
    text = json.dumps(result, indent=2)
    if cfg.out:
        with open(cfg.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
