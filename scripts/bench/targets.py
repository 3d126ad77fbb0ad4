"""Target processes for the benchmarks: start them on the hubs, wait, and sum what they wrote.

Used by every suite of :mod:`scripts.bench.run` that runs real ``edge.target`` processes (main,
lan) and by its pre-drafting comparison.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.bench.common import BenchConfig, run_record
from scripts.bench.harness import Processes, write_prompts
from scripts.bench.inproc import PROMPTS
from starsd.protocol import Stats


def busy_between(before: Stats, after: Stats) -> tuple[float, float]:
    """(hub busy fraction, mean queue wait ms) between two STATS replies."""
    wall = after.wall_s - before.wall_s
    jobs = max(after.jobs - before.jobs, 1)
    return (
        (after.busy_s - before.busy_s) / wall if wall > 0 else 0.0,
        1e3 * (after.queue_wait_s - before.queue_wait_s) / jobs,
    )


def run_targets(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    endpoints: list[str],
    tag: str,
    prefixes: list[list[str]] | None = None,
    concurrency: int = 1,
    extra: Sequence[str] = (),
    cpus: set[int] | None = None,
) -> list[list[dict]]:
    """One target process per endpoint, all at once, each on the full prompt set.

    ``prefixes`` (one per target) run a target elsewhere, e.g. ``ip netns exec NS``;
    ``concurrency``: sequences each target keeps in flight (``--concurrency``); ``extra``: more
    ``edge.target`` options, after (so overriding) these, e.g. ``--gamma 0``; ``cpus``: confine
    the targets to these CPUs.
    """
    prompts = work / "prompts.jsonl"
    write_prompts(prompts, PROMPTS)
    running = []
    for i, endpoint in enumerate(endpoints):
        out = work / f"{tag}-{i}.jsonl"
        args = [
            "-m",
            "edge.target",
            "--hub",
            endpoint,
            "--model",
            cfg.target,
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            str(cfg.max_new_tokens),
            "--gamma",
            str(cfg.gamma),
            "--concurrency",
            str(concurrency),
            *extra,
        ]
        prefix = prefixes[i] if prefixes else None
        running.append((procs.start(args, work / f"{tag}-{i}.log", prefix, cpus), out))
    rows = []
    for proc, out in running:
        if proc.wait(timeout=900) != 0:
            raise RuntimeError(f"{tag}: a target failed; see {out.with_suffix('.log')}")
        rows.append([json.loads(line) for line in out.read_text().splitlines()])
    return rows


def decode_seconds(target_rows: list[dict], concurrency: int = 1) -> float:
    """A target's decoding time: its sequences' own times, ``concurrency`` of them at once."""
    return sum(len(r["token_ids"]) / r["stats"]["tokens_per_s"] for r in target_rows) / concurrency


def targets_record(
    mode: str, rows: list[list[dict]], gamma: int, concurrency: int = 1, **fields: Any
) -> dict:
    """Aggregate target JSONL rows into a record (tokens/s from each sequence's own time; with
    ``concurrency`` > 1 that many sequences of a target decode at once)."""
    per_target, lat, rounds, accepted = [], [], 0, 0
    for target_rows in rows:
        tokens = sum(len(r["token_ids"]) for r in target_rows)
        per_target.append(tokens / decode_seconds(target_rows, concurrency))
        for r in target_rows:
            rounds += r["stats"]["rounds"]
            accepted += r["stats"]["accepted"]
            lat.append(r["stats"]["latency_ms"])
    return run_record(
        mode,
        len(rows),
        system_tokens_per_s=sum(per_target),
        per_target_tokens_per_s=sum(per_target) / len(rows),
        acceptance_rate=accepted / max(rounds * gamma, 1),
        mean_accepted=accepted / max(rounds, 1),
        latency_ms={k: sum(x[k] for x in lat) / len(lat) for k in ("mean", "p50", "p99", "std")},
        concurrency=concurrency,
        **fields,
    )


def proposal_bytes(gamma: int) -> float:
    """Bytes on the wire per greedy round: PROPOSAL + DRAFT, as encoded (plus ZMTP framing)."""
    import numpy as np

    from starsd import protocol

    tag = b"\x00" * protocol.TAG_BYTES
    sizes: list[protocol.Message] = [
        protocol.Proposal(tag, 1, np.zeros(gamma, np.int32)),
        protocol.Draft(tag, 1, 2, np.zeros(1, np.int32)),
    ]
    return float(sum(len(bytes(f)) + 2 for m in sizes for f in protocol.encode(m)))
