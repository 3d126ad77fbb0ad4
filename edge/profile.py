"""``starsd profile target`` and ``starsd profile link``: what a target measures.

Target: the verifier's own backend (:class:`edge.backends.torch.TorchBackend`) after a cached
context of ``context`` tokens, B rows sharing it: T(B), one forward of one new position per row
(B standalone decode steps batched), and V(B, g), one forward of g + 1 positions per row (a
verification of g drafts). Each repeat times every cell once, the order reversed on every other
repeat (this machine's speed drifts), after an untimed warm-up pass; on CUDA the clock stops
after a synchronize.

Link: the round trip of a PING to a hub and its PONG on one open connection (the hub answers
PING before any HELLO, so no session and no model are needed), after one untimed exchange; and,
separately, connect plus the first PING/PONG on a fresh connection (what a target pays to join).
The PINGs are paced (:data:`PING_INTERVAL_S`) to stay within the hub's per-peer message budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from starsd import profile, protocol, transport
from starsd.curve_client import CurveClientConfig

# A PING at most this often on one connection: the hub's default budget is 50 messages a second
# per peer besides accepted DRAFTs (--peer-budget), and a probe over it would be throttled.
PING_INTERVAL_S = 0.025
Cell = tuple[int, int]  # (batch, new positions per row)


def measure_target(
    model_dir: str,
    device: str,
    dtype: str,
    batches: Sequence[int],
    gammas: Sequence[int],
    repeats: int,
    context: int = 128,
    progress: profile.Progress = profile.stderr_progress,
) -> dict[str, Any]:
    """A target profile's JSON object: T(B) and V(B, g) of ``model_dir`` on ``device``."""
    from edge.backends.torch import TorchBackend

    began = time.perf_counter()
    backend = TorchBackend.load(model_dir, device, dtype)
    cells = [(b, w) for w in [1, *(g + 1 for g in gammas)] for b in batches]
    times = _time_forwards(backend, cells, repeats, context, progress)
    grid = {
        "step_ms": [{"batch": b, **profile.summary(times[b, 1])} for b in batches],
        "verify_ms": [
            {"batch": b, "gamma": g, **profile.summary(times[b, g + 1])}
            for g in gammas
            for b in batches
        ],
    }
    model = {"name": backend.info.name, "path": model_dir}
    extra = profile.settings(repeats, context, began)
    return profile.measured_profile("target", model, device, dtype, grid, **extra)


def _time_forwards(
    backend: Any, cells: Sequence[Cell], repeats: int, context: int, progress: profile.Progress
) -> dict[Cell, list[float]]:
    """Seconds per forward of every (B, width) cell after the shared cached context."""
    import torch

    from starsd.batch import SequenceCache

    vocab = backend.info.vocab_size
    sync = torch.cuda.synchronize if backend.loaded.device.type == "cuda" else (lambda: None)
    prompt = [1 + i % (vocab - 1) for i in range(context)]
    (prefix,) = backend.forward([SequenceCache()], [prompt])
    times: dict[Cell, list[float]] = {cell: [] for cell in cells}
    for rep in range(repeats + 1):
        for b, w in profile.alternated(cells, rep):
            feed = [1 + (100 + i) % (vocab - 1) for i in range(w)]
            sync()
            began = time.perf_counter()
            backend.forward([prefix.cache] * b, [feed] * b)
            sync()
            if rep:
                times[(b, w)].append(time.perf_counter() - began)
        progress(f"[target] {'warm-up' if rep == 0 else f'repeat {rep}/{repeats}'} done")
    return times


# ---------------------------------------------------------------------------------- link


def measure_link(
    endpoint: str,
    repeats: int,
    curve: CurveClientConfig | None = None,
    timeout_s: float = 5.0,
    progress: profile.Progress = profile.stderr_progress,
) -> dict[str, Any]:
    """A link profile's JSON object: PING/PONG round trips to the hub at ``endpoint``."""
    began = time.perf_counter()
    rtts, connects = transport.run_loop(probe_link(endpoint, repeats, curve, timeout_s, progress))
    return link_profile(endpoint, rtts, connects, curve is not None, time.perf_counter() - began)


def link_profile(
    endpoint: str, rtts: Sequence[float], connects: Sequence[float], curve: bool, wall_s: float
) -> dict[str, Any]:
    """A link profile's JSON object from :func:`probe_link`'s timings (seconds)."""
    grid = {
        "round_trip_ms": profile.summary(rtts),
        "connect_ms": profile.summary(connects),
        "method": "PING/PONG on one open connection (no HELLO, no session); connect_ms: "
        "connect + the first PING/PONG on a fresh connection",
    }
    machine = profile.machine_info("cpu", "none")
    model = {"name": endpoint, "endpoint": endpoint}
    settings = {"repeats": len(rtts), "order": "alternated", "curve": curve}
    wall = round(wall_s, 2)
    return profile.new_profile("link", model, machine, grid, settings=settings, wall_s=wall)


async def probe_link(
    endpoint: str,
    repeats: int,
    curve: CurveClientConfig | None,
    timeout_s: float,
    progress: profile.Progress = profile.stderr_progress,
) -> tuple[list[float], list[float]]:
    """(round trips on one connection, connect + first round trips) in seconds, one of each
    per repeat; TimeoutError when a PONG does not come within ``timeout_s``."""
    ctx = transport.new_context()
    try:
        sock, watch = transport.dealer(ctx, endpoint, curve)
        try:
            if watch is not None:  # a rejected key fails here, loudly
                await watch.wait(timeout_s)
                watch.close()
            await _ping(sock, 0, timeout_s)  # untimed: the connection's own setup
            rtts, connects = [], []
            for rep in range(repeats):
                await asyncio.sleep(PING_INTERVAL_S)
                rtts.append(await _ping(sock, rep + 1, timeout_s))
                connects.append(await _fresh(ctx, endpoint, curve, rep, timeout_s))
                progress(f"[link] repeat {rep + 1}/{repeats} done")
            return rtts, connects
        finally:
            sock.close(linger=0)
    finally:
        ctx.term()


async def _fresh(
    ctx: Any, endpoint: str, curve: CurveClientConfig | None, nonce: int, timeout_s: float
) -> float:
    """Seconds from connecting a new socket to the PONG of its first PING."""
    began = time.perf_counter()
    sock, watch = transport.dealer(ctx, endpoint, curve)
    try:
        await _ping(sock, 10_000 + nonce, timeout_s)
    finally:
        if watch is not None:
            watch.close()
        sock.close(linger=0)
    return time.perf_counter() - began


async def _ping(sock: Any, nonce: int, timeout_s: float) -> float:
    """Seconds for one PING to come back as its PONG (other messages are skipped)."""
    began = time.perf_counter()
    await transport.send(sock, protocol.Ping(nonce))
    deadline = began + timeout_s
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError(f"no PONG within {timeout_s:.1f} s")
        reply = await asyncio.wait_for(transport.recv(sock), left)
        if isinstance(reply, protocol.Pong) and reply.nonce == nonce:
            return time.perf_counter() - began


def curve_config(secret: str | None, hub_key: str | None) -> CurveClientConfig | None:
    """CURVE settings from key files (both or neither), as ``edge.target`` takes them."""
    if secret is None and hub_key is None:
        return None
    if secret is None or hub_key is None:
        raise ValueError("--curve-secret and --hub-public-key go together")
    return CurveClientConfig(Path(secret), Path(hub_key))
