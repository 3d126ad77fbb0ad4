"""Hub overhead probe: the hub's per-round time against a bare ZeroMQ echo, measured side by side.

A DEALER client times three round trips, alternated A B C A B C so this machine's speed drift
hits all of them alike:

* echo:  scripts/zmq_echo.py, the same socket options and drain loop as the hub, no protocol;
* ping:  PING -> PONG through the hub, i.e. decode, dispatch and encode on the event loop;
* round: DRAFT -> PROPOSAL through a hub running the null drafter, i.e. the whole round path,
  including the handoff to the drafting thread and back, with no model work.

Twice: with a zmq.asyncio client on uvloop, as targets use (the bare round trip the issue
defines: an asyncio DEALER/ROUTER echo), and with a blocking client, which takes the client's
own asyncio costs out of the bare round trip and so gives the stricter ratio.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np
import zmq
import zmq.asyncio

from starsd import protocol, transport
from starsd.protocol import Draft, Hello, Open, Opened, Ping, SamplingParams


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


def _call(sock: zmq.Socket, msg: protocol.Message) -> protocol.Message:
    sock.send_multipart(protocol.encode(msg))
    return protocol.decode(sock.recv_multipart(copy=False))


def _open_session(sock: zmq.Socket, hello: Hello, gamma: int) -> bytes:
    _call(sock, hello)
    opened = _call(sock, Open(1, np.array([1, 2, 3], np.int32), SamplingParams(), gamma))
    if not isinstance(opened, Opened):
        raise RuntimeError(f"hub refused OPEN: {opened}")
    protocol.decode(sock.recv_multipart(copy=False))  # PROPOSAL seq 0
    return opened.tag


async def _acall(sock: zmq.asyncio.Socket, msg: protocol.Message) -> protocol.Message:
    await sock.send_multipart(protocol.encode(msg))
    return protocol.decode(await sock.recv_multipart(copy=False))


def _median_ms(step: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


async def _amedian_ms(step: Callable[[], Awaitable[object]], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(echo_ep: str, hub_ep: str, hello: Hello, rounds: int = 1000, reps: int = 3) -> dict:
    """The asyncio client's figures (see :func:`summary`), with the blocking client's under
    ``blocking_client``."""
    asyncio_samples = transport.run_loop(_measure_asyncio(echo_ep, hub_ep, hello, rounds, reps))
    blocking = summary(_measure_blocking(echo_ep, hub_ep, hello, rounds, reps))
    return {**summary(asyncio_samples), "client": "zmq.asyncio DEALER on uvloop",
            "blocking_client": blocking}  # fmt: skip


async def _measure_asyncio(echo_ep: str, hub_ep: str, hello: Hello, rounds: int, reps: int
                           ) -> dict[str, list[float]]:  # fmt: skip
    ctx = zmq.asyncio.Context()
    echo, hub = _dealer(ctx, echo_ep), _dealer(ctx, hub_ep)
    try:
        tag = await _aopen(hub, hello)
        seq = iter(range(1, 10**9))
        steps = {
            "echo": lambda: _acall(echo, Ping(1)),
            "ping": lambda: _acall(hub, Ping(1)),
            "round": lambda: _acall(hub, Draft(tag, next(seq), 0, np.array([5], np.int32))),
        }
        samples: dict[str, list[float]] = {k: [] for k in steps}
        for step in steps.values():
            await _amedian_ms(step, rounds // 10)  # warm-up
        for _ in range(reps):
            for name, step in steps.items():
                samples[name].append(await _amedian_ms(step, rounds))
        return samples
    finally:
        echo.close()
        hub.close()
        ctx.term()


def link_round_ms(hub_ep: str, hello: Hello, think_s: float, rounds: int = 100) -> float:
    """Median null-drafter round (asyncio client) when the client idles ``think_s`` between
    rounds, as a target does while it verifies: on a VM a CPU that idled that long can take far
    longer to wake than one in a tight loop, and that cost is part of every real round."""
    return transport.run_loop(_link_round_ms(hub_ep, hello, think_s, rounds))


async def _link_round_ms(hub_ep: str, hello: Hello, think_s: float, rounds: int) -> float:
    ctx = zmq.asyncio.Context()
    hub = _dealer(ctx, hub_ep)
    try:
        tag = await _aopen(hub, hello)
        times = []
        for seq in range(1, rounds + 1):
            await asyncio.sleep(think_s)
            t0 = time.perf_counter()
            await _acall(hub, Draft(tag, seq, 0, np.array([5], np.int32)))
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    finally:
        hub.close()
        ctx.term()


async def _aopen(hub: zmq.asyncio.Socket, hello: Hello) -> bytes:
    await _acall(hub, hello)
    opened = await _acall(hub, Open(1, np.array([1, 2, 3], np.int32), SamplingParams(), 4))
    if not isinstance(opened, Opened):
        raise RuntimeError(f"hub refused OPEN: {opened}")
    protocol.decode(await hub.recv_multipart(copy=False))  # PROPOSAL seq 0
    return opened.tag


def _measure_blocking(echo_ep: str, hub_ep: str, hello: Hello, rounds: int, reps: int
                      ) -> dict[str, list[float]]:  # fmt: skip
    ctx = zmq.Context()
    echo, hub = _dealer(ctx, echo_ep), _dealer(ctx, hub_ep)
    try:
        tag = _open_session(hub, hello, gamma=4)
        ping = protocol.encode(Ping(1))
        seq = iter(range(1, 10**9))
        steps = {
            "echo": lambda: (echo.send_multipart(ping), echo.recv_multipart(copy=False)),
            "ping": lambda: _call(hub, Ping(1)),
            "round": lambda: _call(hub, Draft(tag, next(seq), 0, np.array([5], np.int32))),
        }
        for step in steps.values():
            _median_ms(step, rounds // 10)  # warm-up
        samples: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(reps):
            for name, step in steps.items():
                samples[name].append(_median_ms(step, rounds))
    finally:
        echo.close()
        hub.close()
        ctx.term()
    return samples


def summary(samples: dict[str, list[float]]) -> dict:
    """Per-probe figures and the hub's added time as a multiple of the bare echo.

    Each probe's figure is the lowest of its repetitions' medians: this machine's noise only
    ever adds time, and the repetitions are alternated so each probe had the same chances.
    """
    echo_ms, ping_ms, round_ms = (min(samples[k]) for k in ("echo", "ping", "round"))
    return {
        "echo_round_trip_ms": echo_ms,
        "ping_ms": ping_ms,
        "round_ms": round_ms,
        "added_ms": round_ms - echo_ms,
        "added_over_echo": (round_ms - echo_ms) / echo_ms,
        "loop_added_ms": ping_ms - echo_ms,
        "handoff_added_ms": round_ms - ping_ms,
        "samples_ms": samples,
    }
