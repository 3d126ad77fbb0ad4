"""Hub overhead probe: the hub's per-round time against a bare ZeroMQ echo, measured side by side.

A DEALER client times three round trips:

* echo:  scripts/emulate/zmq_echo.py, the same socket options and reader as the hub, no protocol;
* round: DRAFT -> PROPOSAL through a hub running the null drafter, i.e. the whole round path,
  including the handoff to the drafting thread and its send, with no model work;
* ping:  PING -> PONG through the hub, i.e. decode, dispatch and encode on the event loop only.

in two regimes, in one run:

* paced (the headline figures): the client idles ``THINK_MS`` before every probe, as a target
  idles on the network while it verifies, and the probes alternate round by round (echo,
  round, ping, echo, ...). Every service then starts each request from the same idle state,
  and this machine's speed drift hits all probes alike;
* back_to_back: each probe in a tight loop of its own, in alternated blocks: the hot best case
  of both sides, which a hub serving real targets never sees.

Each with a zmq.asyncio client on uvloop, as targets use (the bare round trip the issue
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

THINK_MS = 2.0  # a short verify; longer idles make every wake-up (echo and hub alike) dearer
BLOCKS = 10  # back-to-back blocks per probe; also the stretches the spread is reported over
Samples = dict[str, list[float]]  # probe -> round trip times in ms, in the order measured


def measure(echo_ep: str, hub_ep: str, hello: Hello, rounds: int = 1000) -> dict:
    """Paced figures of the asyncio client (see :func:`summary`), with ``back_to_back`` and,
    under ``blocking_client``, the same two for a blocking client."""
    (paced, tight), (blocking_paced, blocking_tight) = transport.run_loop(
        _measure(echo_ep, hub_ep, hello, rounds)
    )
    return {
        **summary(paced),
        "think_ms": THINK_MS,
        "client": "zmq.asyncio DEALER on uvloop",
        "back_to_back": summary(tight),
        "blocking_client": {**summary(blocking_paced), "back_to_back": summary(blocking_tight)},
    }


def summary(samples: Samples) -> dict:
    """Per-probe medians over all rounds and the hub's added time as a multiple of the echo.

    ``added_over_echo_spread`` repeats the ratio over BLOCKS consecutive stretches of the run,
    to show how far this machine's noise moves it.
    """
    echo_ms, ping_ms, round_ms = (statistics.median(samples[k]) for k in ("echo", "ping", "round"))
    stretches = {k: _stretch_medians(v) for k, v in samples.items()}
    ratios = [(r - e) / e for e, r in zip(stretches["echo"], stretches["round"], strict=True)]
    return {
        "echo_round_trip_ms": echo_ms,
        "ping_ms": ping_ms,
        "round_ms": round_ms,
        "added_ms": round_ms - echo_ms,
        "added_over_echo": (round_ms - echo_ms) / echo_ms,
        "added_over_echo_spread": {"min": min(ratios), "max": max(ratios)},
        "loop_added_ms": ping_ms - echo_ms,
        "handoff_added_ms": round_ms - ping_ms,
        "rounds": len(samples["round"]),
    }


def _stretch_medians(values: list[float]) -> list[float]:
    size = max(1, len(values) // BLOCKS)
    return [statistics.median(values[i : i + size]) for i in range(0, len(values) - size + 1, size)]


# ---------------------------------------------------------------------- probes

Call = Callable[[zmq.Socket, protocol.Message | None], Awaitable[protocol.Message]]
Step = Callable[[], Awaitable[object]]


async def _measure(
    echo_ep: str, hub_ep: str, hello: Hello, rounds: int
) -> tuple[tuple[Samples, Samples], tuple[Samples, Samples]]:
    asyncio_client = await _probe(zmq.asyncio.Context(), _acall, echo_ep, hub_ep, hello, rounds)
    blocking_client = await _probe(
        zmq.Context(), _bcall, echo_ep, hub_ep, hello, rounds, raw_echo=True
    )
    return asyncio_client, blocking_client


async def _probe(
    ctx: zmq.Context,
    call: Call,
    echo_ep: str,
    hub_ep: str,
    hello: Hello,
    rounds: int,
    raw_echo: bool = False,
) -> tuple[Samples, Samples]:
    """(paced, back-to-back) samples of one client kind; ``raw_echo``: the echo probe sends
    pre-encoded frames and decodes nothing (the strictest bare round trip)."""
    echo, hub = _dealer(ctx, echo_ep), _dealer(ctx, hub_ep)
    ping = protocol.encode(Ping(1))
    try:
        tag = await _open(hub, hello, call)
        seq = iter(range(1, 10**9))
        steps: dict[str, Step] = {
            "echo": (lambda: _raw(echo, ping)) if raw_echo else (lambda: call(echo, Ping(1))),
            "round": lambda: call(hub, Draft(tag, next(seq), 0, np.array([5], np.int32))),
            "ping": lambda: call(hub, Ping(1)),
        }
        for step in steps.values():  # warm-up
            for _ in range(rounds // 10):
                await step()
        return await _paced(steps, rounds), await _blocks(steps, rounds)
    finally:
        echo.close()
        hub.close()
        ctx.term()


async def _paced(steps: dict[str, Step], rounds: int) -> Samples:
    samples: Samples = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            await asyncio.sleep(THINK_MS / 1e3)
            t0 = time.perf_counter()
            await step()
            samples[name].append(1e3 * (time.perf_counter() - t0))
    return samples


async def _blocks(steps: dict[str, Step], rounds: int) -> Samples:
    samples: Samples = {name: [] for name in steps}
    for _ in range(BLOCKS):
        for name, step in steps.items():
            for _ in range(rounds // BLOCKS):
                t0 = time.perf_counter()
                await step()
                samples[name].append(1e3 * (time.perf_counter() - t0))
    return samples


async def _acall(sock: zmq.Socket, msg: protocol.Message | None) -> protocol.Message:
    """Send ``msg`` (None: nothing) and decode the reply, the way targets do (zmq.asyncio)."""
    if msg is not None:
        await sock.send_multipart(protocol.encode(msg))
    return protocol.decode(await sock.recv_multipart(copy=False))


async def _bcall(sock: zmq.Socket, msg: protocol.Message | None) -> protocol.Message:
    """The same on a blocking socket: no event-loop I/O inside the timed call."""
    if msg is not None:
        sock.send_multipart(protocol.encode(msg))
    return protocol.decode(sock.recv_multipart(copy=False))


async def _open(hub: zmq.Socket, hello: Hello, call: Call) -> bytes:
    await call(hub, hello)
    opened = await call(hub, Open(1, np.array([1, 2, 3], np.int32), SamplingParams(), 4))
    if not isinstance(opened, Opened):
        raise RuntimeError(f"hub refused OPEN: {opened}")
    await call(hub, None)  # PROPOSAL seq 0
    return opened.tag


async def _raw(sock: zmq.Socket, frames: list[bytes | memoryview]) -> object:
    sock.send_multipart(frames)
    return sock.recv_multipart(copy=False)


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


# ---------------------------------------------------------------------- link time


def link_round_ms(hub_ep: str, hello: Hello, think_s: float, rounds: int = 100) -> float:
    """Median null-drafter round (asyncio client) when the client idles ``think_s`` between
    rounds, as a target does while it verifies: on a VM a CPU that idled that long can take far
    longer to wake than one in a tight loop, and that cost is part of every real round."""
    return transport.run_loop(_link_round_ms(hub_ep, hello, think_s, rounds))


async def _link_round_ms(hub_ep: str, hello: Hello, think_s: float, rounds: int) -> float:
    ctx = zmq.asyncio.Context()
    hub = _dealer(ctx, hub_ep)
    try:
        tag = await _open(hub, hello, _acall)
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
