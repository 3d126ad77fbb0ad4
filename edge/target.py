"""A StarSD target verifier (p side), also the standalone baseline.

    python -m edge.target --hub tcp://HOST:5555 --model DIR --prompt TEXT [--max-new-tokens N]
    python -m edge.target --hub tcp://HOST:5555 --prompts IN.jsonl --out OUT.jsonl --concurrency K
    python -m edge.target --standalone --prompt TEXT     # no hub: plain autoregressive decoding
    python -m edge.target --hub tcp://HOST:5555 --serve [--host 127.0.0.1] [--port 8000]
                                  # an OpenAI-compatible HTTP server (edge.serve), /metrics
    ... [--backend torch|onnxruntime] [--max-batch 32]  # model runtime; rows per batched forward

JSONL in: {"id": ..., "prompt": "...", "max_new_tokens": 32} (optional per line: "messages", a chat
rendered by the chat template, as --chat renders "prompt" as one user turn; "temperature",
"top_k", "top_p", "seed" override the command line; valid ranges: protocol.SamplingParams); out:
{"id", "prompt", "text", "token_ids" (generated ids only), "stats": {"rounds", "accepted",
"mean_accepted", "standalone_steps", "alone_steps", "tokens_per_s", "latency_ms"}}. Each
sequence verifies the hub's proposals in one target forward per round, or decodes the span the hub
asks it to decode alone; its output is exactly what the target alone would produce (greedy: token
for token). The sequences in flight share that forward: whatever work is pending when the model
thread is free runs as one ragged batch of up to --max-batch rows (edge/batcher.py), standalone
steps (--standalone --concurrency K) too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import zmq.asyncio

from edge.backends import BackendUnavailable, load_backend
from edge.backends.base import VerifierBackend
from edge.batcher import Batcher, BatchStats
from edge.engine import Engine
from edge.handshake import HubError, HubUnavailable
from edge.hubs import HubPool
from edge.requests import Request, Result, load_requests, render_chats, write_results
from edge.target_config import PROG, TargetConfig, parse_args
from edge.verifier import TargetSequence
from starsd import curve_client, protocol, transport
from starsd.protocol import SamplingParams

if TYPE_CHECKING:
    from edge.generation import Job

log = logging.getLogger("edge.target")


def new_sequence(
    backend: VerifierBackend,
    config: TargetConfig,
    request: Request,
    index: int,
    taps: tuple[int, ...] = (),
) -> TargetSequence:
    """A fresh sequence for ``request``, not prefilled yet (:meth:`Engine.run` batches that);
    seeds differ per request but not per run. ``taps`` keeps the target's features for an
    EAGLE hub (from the first position on, so the sequence can be re-opened on a hub at any
    point): :meth:`Engine.feature_taps` says which."""
    params = request.sampling or SamplingParams(
        config.temperature, config.top_k, config.top_p, config.seed + index
    )
    prompt = list(request.prompt_ids or backend.encode(request.prompt))
    return TargetSequence(backend, prompt, params, request.max_new_tokens, taps, prefill=False)


def to_result(backend: VerifierBackend, request: Request, seq: TargetSequence) -> Result:
    stats = seq.stats.as_dict(len(seq.generated))
    text = backend.decode(seq.generated)
    return Result(request.id, request.prompt, text, list(seq.generated), stats)


# ---------------------------------------------------------------------- entry point


async def run_with_hub(
    config: TargetConfig,
    backend: VerifierBackend,
    requests: list[Request],
    stats: BatchStats | None = None,
) -> list[Result]:
    """Connect, run every request with ``concurrency`` sequences in flight, disconnect.
    ``stats`` (if given) receives the batcher's figures."""
    ctx = transport.new_context()
    hubs = hub_pool(ctx, config, backend)
    try:
        try:
            await hubs.connect()
        except HubUnavailable as exc:  # decode alone; the clients keep trying to reach the hubs
            log.warning("%s: starting without a hub", exc)
        return await _run_all(config, backend, requests, hubs, stats)
    finally:
        await hubs.aclose()
        ctx.term()


def hub_pool(ctx: zmq.asyncio.Context, config: TargetConfig, backend: VerifierBackend) -> HubPool:
    """One client per ``--hub`` endpoint (not connected yet)."""
    return HubPool.for_model(ctx, config.hubs, backend.info, config.push, config.curves)


async def run_standalone(
    config: TargetConfig,
    backend: VerifierBackend,
    requests: list[Request],
    stats: BatchStats | None = None,
) -> list[Result]:
    """The baseline: every request decoded by the target alone, ``concurrency`` at a time, their
    steps batched."""
    return await _run_all(config, backend, requests, None, stats)


async def _run_all(
    config: TargetConfig,
    backend: VerifierBackend,
    requests: list[Request],
    client: HubPool | None,
    stats: BatchStats | None,
) -> list[Result]:
    """Every request through one engine, ``concurrency`` sequences in flight."""
    limit = asyncio.Semaphore(config.concurrency)
    async with Batcher(backend, config.max_batch, stats=stats, gather=config.gather) as batcher:
        engine = Engine(backend, batcher, client, config.gamma, config.fallback)
        log.info(
            "verifying with the %s backend, up to %d rows per forward, %d sequences in flight",
            getattr(backend, "name", type(backend).__name__),
            config.max_batch,
            config.concurrency,
        )

        bar = _progress(config, len(requests))

        async def one(index: int, request: Request) -> Result:
            async with limit:
                seq = new_sequence(backend, config, request, index, engine.feature_taps())
                await engine.run(seq)
                _log_sequence(request, seq)
                bar.update(1)
                return to_result(backend, request, seq)

        try:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
        finally:
            bar.close()


def _progress(config: TargetConfig, total: int) -> Any:
    """A tqdm bar over --prompts on a terminal (stderr); a silent one otherwise."""
    from tqdm import tqdm

    quiet = config.prompts is None or not sys.stderr.isatty()
    return tqdm(total=total, unit="seq", disable=quiet, file=sys.stderr)


def _log_sequence(request: Request, seq: TargetSequence) -> None:
    s = seq.stats.as_dict(len(seq.generated))
    log.info(
        "sequence %s: %d tokens, %d rounds, mean_accepted %.2f, %.1f tok/s",
        request.id,
        len(seq.generated),
        s["rounds"],
        s["mean_accepted"],
        s["tokens_per_s"],
    )


def _log_summary(results: list[Result], wall: float, batches: BatchStats) -> None:
    tokens = sum(len(r.token_ids) for r in results)
    rounds = sum(int(r.stats["rounds"]) for r in results)
    accepted = sum(int(r.stats["accepted"]) for r in results)
    log.info(
        "done: %d sequences, %d tokens in %.2f s (%.1f tok/s), mean_accepted %.2f, "
        "%d forwards, mean rows per forward %.2f (max %d)",
        len(results),
        tokens,
        wall,
        tokens / max(wall, 1e-9),
        accepted / rounds if rounds else 0.0,
        batches.forwards,
        batches.mean_rows,
        batches.max_rows,
    )


def job_sequence(
    backend: VerifierBackend, config: TargetConfig, job: Job, index: int, taps: tuple[int, ...]
) -> TargetSequence:
    """The sequence of an HTTP request (edge.serve): built as a --prompts line's is (not
    prefilled: the server's engine batches that)."""
    request = Request(None, "", job.max_tokens, job.params, prompt_ids=job.prompt_ids)
    return new_sequence(backend, config, request, index, taps)


def _serve(config: TargetConfig) -> int:
    from edge import serve  # fastapi, uvicorn, prometheus_client: only for --serve

    backend = open_backend(config)
    if backend is None:
        return 2
    return serve.main(config, backend, functools.partial(job_sequence, backend, config))


def open_backend(config: TargetConfig) -> VerifierBackend | None:
    """The target's backend (torch threads set first), or None once the error is printed."""
    torch.set_num_threads(config.threads)
    options: dict[str, Any] = {} if config.providers is None else {"providers": config.providers}
    if config.forward != "auto":
        options["forward"] = config.forward
    try:
        return load_backend(config.backend, config.model, config.device, config.dtype, **options)
    except (BackendUnavailable, ValueError, OSError) as exc:  # a missing model, a refused export...
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m edge.target``; returns the exit code."""
    logging.basicConfig(
        level=os.environ.get("STARSD_LOG", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = parse_args(argv)
    if config.serve:
        return _serve(config)
    try:  # a bad line is refused like a bad option: before loading any model
        requests = load_requests(config)
    except (OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    backend = open_backend(config)
    if backend is None:
        return 2
    try:
        requests = render_chats(backend, requests)
    except ValueError as exc:
        print(f"{PROG}: error: {config.model}: {exc}", file=sys.stderr)
        return 2
    started, batches = time.perf_counter(), BatchStats()
    run = run_standalone if config.standalone else run_with_hub
    try:
        results = transport.run_loop(run(config, backend, requests, batches))
    except (HubError, protocol.ProtocolError, curve_client.HandshakeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    _log_summary(results, time.perf_counter() - started, batches)
    write_results(config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
