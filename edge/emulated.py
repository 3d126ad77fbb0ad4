"""Emulated targets: the real protocol to the real hub, with the target forward replaced.

    python -m edge.emulated --hub tcp://HOST:5555 --model TARGET_DIR --targets 64 \
        --alpha 0.7 --verify-ms 5 --duration 5 --out emulated.json

Each emulated target is its own DEALER connection with one sequence in flight. Instead of a
target forward it waits ``--verify-ms`` (without blocking the loop) and draws the number of
accepted tokens from an i.i.d. acceptance process with rate ``--alpha`` (seeded), so one process
can stand in for far more targets than the machine could run as real models. The hub drafts for
real. The report carries system and per-target throughput, per-token latency, bytes per round and
the hub's busy fraction over the measured window (from STATS replies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from edge.client import HubClient, TargetInfo
from starsd import models, protocol, transport
from starsd.protocol import Proposal, SamplingParams, Stats
from starsd.stats import latency_summary

PROMPT_TOKENS = 16


@dataclass(frozen=True)
class EmulationConfig:
    """What ``python -m edge.emulated`` is told."""

    hub: str
    targets: int = 8
    alpha: float = 0.7
    verify_ms: float = 5.0
    gamma: int = 4
    duration: float = 5.0
    warmup: float = 1.0
    max_new_tokens: int = 128  # then the sequence closes and a new one opens
    seed: int = 0
    model: str = str(models.DEFAULT_TARGET_DIR)  # whose tokenizer the emulated targets claim
    out: str | None = None


@dataclass
class TargetRecord:
    """What one emulated target measured inside the window."""

    tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    bytes: int = 0
    round_s: float = 0.0
    verify_s: float = 0.0
    token_latency_s: list[float] = field(default_factory=list)


def accepted_count(rng: random.Random, alpha: float, gamma: int) -> int:
    """Accepted drafts of one round when each is accepted with probability alpha, in order."""
    n = 0
    while n < gamma and rng.random() < alpha:
        n += 1
    return n


async def run_target(
    client: HubClient, cfg: EmulationConfig, index: int, window: tuple[float, float],
    record: TargetRecord,
) -> None:  # fmt: skip
    """One emulated target: sequences back to back until the window closes."""
    rng = random.Random(cfg.seed * 100_003 + index)
    vocab = client.info.vocab_size
    while time.perf_counter() < window[1]:
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
        tag, inbox = await client.open(prompt, SamplingParams(), cfg.gamma)
        await _one_sequence(client, cfg, rng, tag, inbox, window, record)
        await client.close_session(tag)


async def _one_sequence(
    client: HubClient, cfg: EmulationConfig, rng: random.Random, tag: bytes,
    inbox: asyncio.Queue[protocol.Message], window: tuple[float, float], record: TargetRecord,
) -> None:  # fmt: skip
    seq, generated, asked = 0, 0, time.perf_counter()
    while generated < cfg.max_new_tokens and time.perf_counter() < window[1]:
        msg = await inbox.get()
        if not isinstance(msg, Proposal):
            raise RuntimeError(f"hub: {msg}")
        verify_started = time.perf_counter()
        await asyncio.sleep(cfg.verify_ms / 1e3)
        accepted = accepted_count(rng, cfg.alpha, len(msg.tokens))
        now = time.perf_counter()
        if window[0] <= now <= window[1]:  # a round still in flight at the end does not count
            _record_round(record, msg, accepted, now - asked)
            record.verify_s += now - verify_started  # the timer overshoots the nominal time
        generated += accepted + 1
        seq += 1
        asked = time.perf_counter()
        await client.draft(tag, seq, accepted, [rng.randrange(client.info.vocab_size)])


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
    target = models.load_causal_lm(cfg.model)  # only for its vocabulary and tokenizer
    ctx = transport.new_context()
    info = TargetInfo("emulated", target.vocab_size, target.tokenizer_fingerprint)
    clients = [HubClient(ctx, cfg.hub, info) for _ in range(cfg.targets)]
    try:
        await asyncio.gather(*(c.connect() for c in clients))
        start = time.perf_counter() + cfg.warmup
        window = (start, start + cfg.duration)
        records = [TargetRecord() for _ in clients]
        tasks = [asyncio.create_task(run_target(c, cfg, i, window, records[i]))
                 for i, c in enumerate(clients)]  # fmt: skip
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        before = await clients[0].stats()
        await asyncio.gather(*tasks)
        after = await clients[0].stats()
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
        ctx.term()
    return report(cfg, records, before, after)


def report(cfg: EmulationConfig, records: list[TargetRecord], before: Stats, after: Stats) -> dict:
    """Aggregate the per-target records and the hub's counters over the window."""
    latencies = sorted(x for r in records for x in r.token_latency_s)
    tokens = sum(r.tokens for r in records)
    rounds = sum(r.rounds for r in records)
    wall = after.wall_s - before.wall_s
    jobs = max(after.jobs - before.jobs, 1)
    return {
        "config": asdict(cfg),
        "n_targets": cfg.targets,
        "system_tokens_per_s": tokens / cfg.duration,
        "per_target_tokens_per_s": tokens / cfg.duration / cfg.targets,
        "hub_busy_fraction": (after.busy_s - before.busy_s) / wall if wall > 0 else 0.0,
        "draft_service_s": (after.busy_s - before.busy_s) / jobs,
        "hub_busy_s": after.busy_s - before.busy_s,
        "hub_jobs": after.jobs - before.jobs,
        "queue_wait_ms": 1e3 * (after.queue_wait_s - before.queue_wait_s) / jobs,
        "acceptance_rate": sum(r.accepted for r in records) / max(rounds * cfg.gamma, 1),
        "mean_accepted": sum(r.accepted for r in records) / max(rounds, 1),
        "bytes_per_round": sum(r.bytes for r in records) / max(rounds, 1),
        "rounds": rounds,
        "tokens_in_window": tokens,
        "round_ms": 1e3 * sum(r.round_s for r in records) / max(rounds, 1),
        "verify_ms": 1e3 * sum(r.verify_s for r in records) / max(rounds, 1),
        "latency_ms": latency_summary(latencies),
        "token_latency_ms": [round(1e3 * x, 4) for x in latencies],  # for pooling across runs
    }


def parse_args(argv: list[str] | None = None) -> EmulationConfig:
    """argparse -> EmulationConfig."""
    p = argparse.ArgumentParser(prog="python -m edge.emulated", description=__doc__.split("\n")[0])
    p.add_argument("--hub", required=True)
    p.add_argument("--targets", type=int, default=EmulationConfig.targets)
    p.add_argument("--alpha", type=float, default=EmulationConfig.alpha)
    p.add_argument("--verify-ms", type=float, default=EmulationConfig.verify_ms)
    p.add_argument("--gamma", type=int, default=EmulationConfig.gamma)
    p.add_argument("--duration", type=float, default=EmulationConfig.duration)
    p.add_argument("--warmup", type=float, default=EmulationConfig.warmup)
    p.add_argument("--max-new-tokens", type=int, default=EmulationConfig.max_new_tokens)
    p.add_argument("--seed", type=int, default=EmulationConfig.seed)
    p.add_argument("--model", default=EmulationConfig.model, help="target dir (tokenizer only)")
    p.add_argument("--out")
    return EmulationConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m edge.emulated``."""
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
