"""The hub's ROUTER (starsd.hub.router.Router) under the hub's own traffic pattern, on loopback.

libzmq's socket FD is edge-triggered: any send or receive may consume the notification of a
message that arrived meanwhile. A Router that missed one would leave a client waiting forever,
so these tests bound every wait and fail instead of hanging.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import zmq

from starsd import protocol, transport
from starsd.hub.router import BindError, Received, bind_router
from starsd.protocol import Ping, Pong

REPO = Path(__file__).resolve().parent.parent
CLIENTS = 6
ROUNDS = 300


async def _client(ctx: zmq.asyncio.Context, endpoint: str, index: int, rounds: int = ROUNDS) -> int:
    """Ping-pong ``rounds`` times; every reply must carry the nonce just sent."""
    sock, _ = transport.dealer(ctx, endpoint)
    try:
        for i in range(rounds):
            nonce = index * rounds + i
            await sock.send_multipart(protocol.encode(Ping(nonce)))
            reply = protocol.decode(await asyncio.wait_for(sock.recv_multipart(), 5.0))
            assert isinstance(reply, Pong) and reply.nonce == nonce
        return rounds
    finally:
        sock.close(linger=0)


def test_an_endpoint_in_use_is_a_clear_error_and_the_context_still_ends() -> None:
    """Catches a hub that cannot bind hanging for ever instead of exiting: the ROUTER it made
    stayed open, so the context's term() waited on it (measured: a second hub on a busy port
    printed a traceback and never exited)."""
    busy_ctx, ctx = transport.new_context(), transport.new_context()
    first = bind_router(busy_ctx, "tcp://127.0.0.1:*")
    try:
        with pytest.raises(
            BindError, match=r"cannot bind tcp://127\.0\.0\.1:\d+: Address already in use"
        ):
            bind_router(ctx, first.endpoint)
    finally:
        first.close()
        busy_ctx.term()
    ended = threading.Thread(target=ctx.term, daemon=True)
    ended.start()
    ended.join(10)
    assert not ended.is_alive()


async def test_every_client_gets_its_replies_when_a_worker_thread_answers() -> None:
    """Like the hub: requests are read on the loop and answered by a worker thread's own sends,
    while other clients' requests keep arriving (the lockstep test below is the one that
    catches a lost wake-up; here later arrivals would mask it)."""
    ctx = transport.new_context()
    router = bind_router(ctx, "tcp://127.0.0.1:*")
    work: list[tuple[bytes, int]] = []
    ready = threading.Condition()
    stopping = threading.Event()

    def on_batch(batch: list[Received]) -> None:
        with ready:
            for received in batch:
                msg = protocol.decode(received.frames)
                assert isinstance(msg, Ping)
                work.append((received.peer, msg.nonce))
            ready.notify()

    def worker() -> None:
        rng = np.random.default_rng(0)
        while not stopping.is_set():
            with ready:
                ready.wait_for(lambda: bool(work) or stopping.is_set(), timeout=0.1)
                jobs, work[:] = list(work), []
            for peer, nonce in jobs:
                if rng.random() < 0.3:  # sometimes reply late, so sends interleave with arrivals
                    stopping.wait(rng.random() * 1e-3)
                router.send(peer, Pong(nonce))

    thread = threading.Thread(target=worker)
    thread.start()
    router.start(on_batch)
    try:
        done = await asyncio.wait_for(
            asyncio.gather(*(_client(ctx, router.endpoint, i) for i in range(CLIENTS))), 60.0
        )
        assert done == [ROUNDS] * CLIENTS
    finally:
        stopping.set()
        thread.join()
        router.close()
        ctx.term()


async def test_a_lockstep_client_is_read_while_the_hub_keeps_sending_to_others() -> None:
    """The case that once left a target unread for a minute: its one request arrives while the
    hub is busy sending to someone else, and nothing else arrives after it to re-signal."""
    ctx = transport.new_context()
    router = bind_router(ctx, "tcp://127.0.0.1:*")
    sink, _ = transport.dealer(ctx, router.endpoint)
    peers: dict[str, bytes] = {}
    noise_sent = [0]
    stopping = threading.Event()

    def on_batch(batch: list[Received]) -> None:
        for received in batch:
            msg = protocol.decode(received.frames)
            assert isinstance(msg, Ping)
            if msg.nonce < 0:
                peers["sink"] = received.peer
            else:
                router.send(received.peer, Pong(msg.nonce))

    def noise() -> None:  # a steady stream of sends to the sink, from another thread (as the
        while not stopping.wait(5e-5):  # drafting thread sends while the loop reads)
            if "sink" in peers:
                router.send(peers["sink"], Pong(-1))
                noise_sent[0] += 1

    router.start(on_batch)
    await sink.send_multipart(protocol.encode(Ping(-1)))
    for _ in range(500):  # the noise needs the sink's routing id: without it nothing is sent
        if "sink" in peers:
            break
        await asyncio.sleep(0.01)
    thread = threading.Thread(target=noise)
    thread.start()
    try:
        assert await asyncio.wait_for(_client(ctx, router.endpoint, 0, rounds=2000), 60.0) == 2000
        # Without sends to others during the lockstep rounds this test cannot fail (it would
        # pass with the bug it is about); make sure there were plenty.
        assert noise_sent[0] >= 100, noise_sent
    finally:
        stopping.set()
        thread.join()
        sink.close(linger=0)
        router.close()
        ctx.term()


async def test_a_send_to_a_vanished_peer_is_reported_not_raised() -> None:
    ctx = transport.new_context()
    router = bind_router(ctx, "tcp://127.0.0.1:*")
    router.start(lambda batch: None)
    try:
        assert router.send(b"\x00no-such-peer", Pong(1)) is False
    finally:
        router.close()
        ctx.term()


_STALLED_READER = """
import time, zmq
from starsd import limits
from starsd.hub.router import bind_router
limits.HWM = 1000  # reached at once here; a PING flood reached the default in the hub too
ctx = zmq.Context()
router = bind_router(ctx, "tcp://127.0.0.1:*")
for trial in range(3):
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.SNDHWM, 100_000)
    peer.connect(router.endpoint)
    for _ in range(50_000):
        peer.send(b"x" * 64)
    time.sleep(0.5)  # the hub is busy elsewhere: the peer's pipe fills, its input stops
    peer.close(linger=0)  # ... and the peer vanishes while its input is stopped
    time.sleep(1.5)  # the hub's timers run (a ZMTP heartbeat was every second)
    while router.sock.poll(100):
        router.sock.recv_multipart()
print("alive")
"""


def test_a_peer_that_floods_then_vanishes_cannot_abort_the_hub() -> None:
    """Catches: libzmq 4.3.5 asserts (!_io_error, stream_engine_base.cpp:310) and aborts the
    process when a ZMTP heartbeat timer fires on a connection whose peer vanished while its
    input was stopped at the receive high-water mark; any peer can arrange that with a flood.
    The hub's ROUTER therefore sends no heartbeats (nor do targets: the same abort hit them,
    tests/test_hostile_hub_e2e.py). Seen to abort with heartbeats on the ROUTER."""
    proc = subprocess.run(
        [sys.executable, "-c", _STALLED_READER],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and "alive" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
