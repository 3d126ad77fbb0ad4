"""Load generator for ``edge.target --serve``: C concurrent streaming clients, bounded.

    python -m scripts.bench.load --url http://127.0.0.1:8000 [--concurrency 4] [--requests 64]
    python -m scripts.bench.load [--quick]     # starts a hub + `edge.target --serve` on the default
                                         # pair itself, then the same with --standalone

Each client sends streamed /v1/completions (greedy, include_usage) one after another until the
request count is reached or the duration is up (requests in flight then finish). Reported per
run: time to first token and inter-token latency p50 / p99 (client side; a chunk can carry several
tokens when a round accepts drafts, so per-chunk gaps are reported and, per request, time per
output token after the first), output tokens/s over the run's wall time, errors by HTTP status,
and (when the script starts the server itself) the server's resident memory when it is ready,
after the load and at its peak (``server_rss_mb``): ``--requests 100 --max-tokens 512`` gives
the memory of 100 sequences of 512 tokens, through the hub and standalone.
Nothing is lost: every request ends as a completion or a counted error, and the script checks it.
Writes results/load.json (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from scripts.bench.harness import PROMPTS, REPO, Processes, start_hub, wait_for_line
from starsd import models


@dataclass
class Tally:
    """What one run's clients observed."""

    ttft_s: list[float] = field(default_factory=list)
    chunk_gap_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)  # per request: (end - first) / (n - 1)
    tokens: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0


async def one_request(
    http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, tally: Tally
) -> None:
    """One streamed completion; its timings go to ``tally`` (or its error)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, stamps, tokens = time.perf_counter(), [], 0
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                tally.errors[str(r.status_code)] += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.errors["stream_error"] += 1
                    return
                if any(c.get("text") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        tally.errors[type(exc).__name__] += 1
        return
    tally.ok += 1
    tally.tokens += tokens
    if stamps:
        tally.ttft_s.append(stamps[0] - started)
        tally.chunk_gap_s.extend(b - a for a, b in itertools.pairwise(stamps))
    if len(stamps) > 1 and tokens > 1:
        tally.tpot_s.append((stamps[-1] - stamps[0]) / (tokens - 1))


async def run_load(
    url: str, concurrency: int, requests: int, duration_s: float, max_tokens: int
) -> dict[str, Any]:
    """C clients against ``url`` until ``requests`` are sent or ``duration_s`` is up."""
    tally = Tally()
    deadline = time.monotonic() + duration_s
    async with httpx.AsyncClient(
        timeout=120, limits=httpx.Limits(max_connections=concurrency)
    ) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]

        async def client() -> None:
            while tally.sent < requests and time.monotonic() < deadline:
                prompt = PROMPTS[tally.sent % len(PROMPTS)]
                tally.sent += 1
                await one_request(http, url, model, prompt, max_tokens, tally)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        server = (await http.get(f"{url}/metrics")).text
    lost = tally.sent - tally.ok - sum(tally.errors.values())
    assert lost == 0, f"{lost} requests neither completed nor failed"
    return summarize(tally, wall, concurrency, server)


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def summarize(tally: Tally, wall: float, concurrency: int, metrics: str) -> dict[str, Any]:
    """The run's record: latency percentiles, throughput, errors, the server's acceptance."""
    figures = _acceptance(metrics)
    return {
        "concurrency": concurrency,
        "requests": tally.sent,
        "completed": tally.ok,
        "errors": dict(tally.errors),
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(tally.tokens / wall, 2) if wall > 0 else None,
        "ttft_ms": {"p50": _ms(tally.ttft_s, 0.5), "p99": _ms(tally.ttft_s, 0.99)},
        "itl_ms": {"p50": _ms(tally.chunk_gap_s, 0.5), "p99": _ms(tally.chunk_gap_s, 0.99)},
        "tpot_ms": {
            "p50": _ms(tally.tpot_s, 0.5),
            "p99": _ms(tally.tpot_s, 0.99),
            "mean": round(1e3 * statistics.fmean(tally.tpot_s), 2) if tally.tpot_s else None,
        },
        **figures,
    }


def _acceptance(metrics: str) -> dict[str, float | None]:
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    drafts = totals.get("starsd:spec_decode_num_drafts_total", 0.0)
    proposed = totals.get("starsd:spec_decode_num_draft_tokens_total", 0.0)
    accepted = totals.get("starsd:spec_decode_num_accepted_tokens_total", 0.0)
    return {
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted": round(accepted / drafts, 3) if drafts else None,
    }


def serve_and_load(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Hub + ``edge.target --serve``, then ``--serve --standalone``, the same load on each."""
    runs: dict[str, Any] = {}
    for mode in args.modes:
        procs = Processes()
        try:
            extra = ["--standalone"]
            if mode == "hub":
                _, endpoint = start_hub(procs, args.draft, logs / "hub.log")
                extra = ["--hub", endpoint]
            log = logs / f"target-{mode}.log"
            proc = procs.start(
                [
                    "-m",
                    "edge.target",
                    "--serve",
                    "--port",
                    "0",
                    "--model",
                    args.target,
                    "--concurrency",
                    str(args.concurrency),
                    "--max-queue",
                    str(4 * args.concurrency),
                    *extra,
                ],
                log,
            )
            url = wait_for_line(log, r"serving \S+ on (http://\S+)/v1", proc)
            print(f"{mode}: {url}", file=sys.stderr)
            ready = _rss_mb(proc.pid)
            runs[mode] = asyncio.run(
                run_load(url, args.concurrency, args.requests, args.duration, args.max_tokens)
            )
            runs[mode]["server_rss_mb"] = {
                "ready": ready,
                "after": _rss_mb(proc.pid),
                "peak": _rss_mb(proc.pid, "VmHWM"),
            }
            print(f"{mode}: {json.dumps(runs[mode])}", file=sys.stderr)
        finally:
            procs.stop_all()
    return runs


def _rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    """A process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MB (Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((ln for ln in status.splitlines() if ln.startswith(field + ":")), None)
    return round(int(line.split()[1]) / 1024, 1) if line else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server; without it the script starts its own")
    p.add_argument("--quick", action="store_true", help="a short run (make load QUICK=1)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, help="total requests (default 24, quick 12)")
    p.add_argument(
        "--duration", type=float, help="stop sending after this (s; default 300, quick 90)"
    )
    p.add_argument("--max-tokens", type=int, help="per request (default 64, quick 32)")
    p.add_argument("--target", default=str(models.TOY_TARGET_DIR))
    p.add_argument("--draft", default=str(models.TOY_DRAFT_DIR))
    p.add_argument(
        "--modes", nargs="+", default=["hub", "standalone"], choices=["hub", "standalone"]
    )
    p.add_argument("--out", default=str(REPO / "results" / "load.json"))
    args = p.parse_args(argv)
    args.requests = args.requests or (12 if args.quick else 24)
    args.duration = args.duration or (90.0 if args.quick else 300.0)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        runs = {
            "server": asyncio.run(
                run_load(args.url, args.concurrency, args.requests, args.duration, args.max_tokens)
            )
        }
    else:
        with tempfile.TemporaryDirectory(prefix="starsd-load-") as logs:
            runs = serve_and_load(args, Path(logs))
    settings = {k: v for k, v in vars(args).items() if k not in {"out"}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": settings, "runs": runs}, indent=1) + "\n")
    for name, run in runs.items():
        print(
            f"{name:>10}: {run['completed']}/{run['requests']} ok, errors {run['errors']}, "
            f"TTFT p50/p99 {run['ttft_ms']['p50']}/{run['ttft_ms']['p99']} ms, ITL p50/p99 "
            f"{run['itl_ms']['p50']}/{run['itl_ms']['p99']} ms, TPOT p50 "
            f"{run['tpot_ms']['p50']} ms, {run['output_tokens_per_s']} tok/s, "
            f"mean_accepted {run['mean_accepted']}"
        )
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
