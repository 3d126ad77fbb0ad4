"""Duplicates, reordering, leases, quotas, fairness, draining; a fuzz of the hub dispatcher."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import PROMPT, RawTarget, RunningHub, serving_hub
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hub import _greedy_reference

from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.client import HubClient
from edge.handshake import TargetInfo
from edge.speculate import Fallback, generate_speculative
from edge.verifier import TargetSequence
from starsd import hub as hub_module
from starsd import models, protocol, transport
from starsd.hub.scheduler import FairQueue
from starsd.protocol import (
    Close,
    Draft,
    Error,
    ErrorCode,
    Hello,
    Open,
    Opened,
    Ping,
    Pong,
    Proposal,
    SamplingParams,
    StatsRequest,
    Welcome,
)

# ---------------------------------------------------------------------- duplicates and order


async def test_duplicate_and_reordered_drafts_never_apply_twice(
    raw, llama_target: models.LoadedModel
) -> None:
    noisy, clean = raw(), raw()
    for t in (noisy, clean):
        await t.hello(llama_target)
    tag, _ = await noisy.open()
    ref_tag, _ = await clean.open(ref=2)
    verdicts = [(1, [7]), (0, [9]), (2, [11])]
    for seq, (accepted, appended) in enumerate(verdicts, start=1):
        draft = Draft(tag, seq, accepted, np.array(appended, dtype=np.int32))
        await noisy.send(draft)
        await noisy.send(draft)  # a duplicate, and a stale and a future seq
        await noisy.send(Draft(tag, seq - 1, accepted, np.array(appended, dtype=np.int32)))
        await noisy.send(Draft(tag, seq + 5, 0, np.array(appended, dtype=np.int32)))
        replies = [await noisy.recv() for _ in range(4)]
        proposals = [r for r in replies if isinstance(r, Proposal)]
        errors = sorted(r.code for r in replies if isinstance(r, Error))
        assert len(proposals) == 1 and set(errors) <= {ErrorCode.BUSY, ErrorCode.OUT_OF_ORDER}
        reference = await clean.ask(Draft(ref_tag, seq, accepted, np.array(appended, np.int32)))
        assert isinstance(reference, Proposal)
        assert proposals[0].tokens.tolist() == reference.tokens.tolist()  # same state as once


async def test_client_ignores_duplicate_and_stale_proposals(
    running_hub: RunningHub, llama_target: models.LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a client that verifies a duplicate or a stale proposal (drops the seq check).

    Greedy output equals the target alone whatever gets verified, so the output cannot show
    it; the round count can: one verification per distinct proposal, no more.
    """
    deliver = HubClient._deliver
    proposals: set[int] = set()  # the seqs the hub really sent

    def twice(self: HubClient, key: int | bytes, msg: protocol.Message) -> None:
        deliver(self, key, msg)
        if isinstance(msg, Proposal):  # every proposal twice, then a stale one
            proposals.add(msg.seq)
            deliver(self, key, msg)
            deliver(self, key, Proposal(msg.tag, msg.seq - 1, msg.tokens[::-1]))

    monkeypatch.setattr(HubClient, "_deliver", twice)
    ctx = transport.new_context()
    info = TargetInfo("t", llama_target.vocab_size, llama_target.tokenizer_fingerprint)
    client = HubClient(ctx, running_hub.endpoint, info)
    await client.connect()
    seq = TargetSequence(TorchBackend(llama_target), PROMPT.tolist(), SamplingParams(), 30)
    # A deadline no round here comes near: every round is a verification, none a fallback.
    async with Batcher(seq.backend) as batcher:
        await generate_speculative(client, seq, 4, batcher, Fallback(deadline_s=5.0))
    await client.aclose()
    ctx.term()
    assert seq.generated == _greedy_reference(llama_target, PROMPT.tolist(), 30)
    assert seq.stats.standalone_steps == 0
    assert seq.stats.rounds == len(proposals) == max(proposals) + 1 > 1


# ---------------------------------------------------------------------- leases, quotas, drain


async def test_a_silent_target_loses_its_sessions_after_its_lease(
    raw, running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    """Catches: a PING that does not renew the lease, a lease shorter than LEASE_INTERVALS
    heartbeats, expiry that frees the wrong target's sessions, and a session that survives
    its target's expiry."""
    hub = running_hub.hub
    silent, talking = raw(), raw()
    for t in (talking, silent):
        await t.hello(llama_target)
    talking_tag, _ = await talking.open(ref=2)
    silent_tag, _ = await silent.open()  # the silent target's last message
    await talking.ask(Ping(1))  # after it: without the PING, talking would be the older one
    quiet_since = hub.table.peers[_routing_id(hub, silent_tag)].last_seen
    renewed = hub.table.peers[_routing_id(hub, talking_tag)].last_seen
    assert renewed > quiet_since
    lease = protocol.LIVENESS_INTERVALS * hub.config.heartbeat_s
    hub.table.clock = lambda: quiet_since + lease  # exactly at the lease: still alive
    assert hub.expire_leases() == 0
    # Past the silent target's lease, within the talking one's only thanks to the PING.
    hub.table.clock = lambda: (quiet_since + renewed) / 2 + lease
    assert hub.expire_leases() == 1
    assert silent_tag not in hub.sessions and talking_tag in hub.sessions
    reply = await silent.ask(Draft(silent_tag, 1, 0, PROMPT[:1]))
    assert isinstance(reply, Error) and reply.code == ErrorCode.NOT_WELCOMED


def _routing_id(hub: hub_module.Hub, tag: bytes) -> bytes:
    return hub.sessions[tag].routing_id


async def test_a_round_that_raises_ends_its_sessions_and_the_hub_drafts_on(
    raw, running_hub: RunningHub, llama_target: models.LoadedModel, monkeypatch
) -> None:
    """Catches a drafting thread that dies on one failed round (a proposer bug, the device out
    of memory): every target would then wait on a hub that answers nothing again. The failed
    session gets INTERNAL (its target re-opens it) and the next round is drafted as usual."""
    engine = running_hub.hub.engine
    target = raw()
    await target.hello(llama_target)
    tag, _ = await target.open()
    drafted = engine.proposer.propose
    monkeypatch.setattr(engine.proposer, "propose", _raises_once(drafted))
    await target.send(Draft(tag, 1, 2, np.array([9], dtype=np.int32)))
    reply = await target.recv()
    assert isinstance(reply, Error) and reply.code == ErrorCode.INTERNAL and reply.tag == tag
    tag2, proposal = await target.open(ref=2)  # the hub drafts on
    assert tag2 != tag and len(proposal.tokens) == 4
    assert engine.thread.is_alive() and engine.stats.rounds_failed == 1
    reply = await target.ask(Draft(tag, 1, 2, np.array([9], dtype=np.int32)))
    assert isinstance(reply, Error) and reply.code == ErrorCode.UNKNOWN_SESSION  # it ended


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_hub_whose_drafting_thread_died_stops_and_tells_its_targets(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel, monkeypatch
) -> None:
    """Catches a hub that keeps answering pings with no drafting thread (every target then
    waits out its deadline each round): it stops within a heartbeat, tells its targets
    SHUTTING_DOWN and marks itself failed (``python -m starsd.hub`` exits 1)."""
    config = hub_module.HubConfig(
        model=str(llama_pair[1]), bind="tcp://127.0.0.1:*", stats_interval=3600, heartbeat_s=0.2
    )
    async with serving_hub(config) as running:
        hub = running.hub
        target = RawTarget(running.endpoint)
        try:
            await target.hello(llama_target)
            tag, _ = await target.open()

            def dies(jobs):
                raise SystemExit("not an Exception: ends the thread")

            monkeypatch.setattr(hub.engine.proposer, "propose", dies)
            await target.send(Draft(tag, 1, 2, np.array([9], dtype=np.int32)))
            reply = await target.recv(timeout=10)
            assert isinstance(reply, Error) and reply.code == ErrorCode.SHUTTING_DOWN
            await asyncio.wait_for(running.task, 10)
            assert hub.failed and not hub.engine.thread.is_alive()
        finally:
            target.close()


def _raises_once(propose):
    """``propose`` that raises on its first call only."""
    calls = []

    def flaky(jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise RuntimeError("a proposer bug")
        return propose(jobs)

    return flaky


async def test_per_target_session_quota(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    config = hub_module.HubConfig(model=str(llama_pair[1]), max_sessions_per_target=2)
    hub = hub_module.build_hub(config)
    hello = Hello("t", llama_target.vocab_size, llama_target.tokenizer_fingerprint)
    hub.handle(b"A", protocol.encode(hello))
    hub.handle(b"B", protocol.encode(hello))
    opens = [
        hub.handle(b"A", protocol.encode(Open(i, PROMPT, SamplingParams(), 4)))[0] for i in range(3)
    ]
    assert [type(r).__name__ for r in opens] == ["Opened", "Opened", "Error"]
    assert isinstance(opens[2], Error) and opens[2].code == ErrorCode.RESOURCE_EXHAUSTED
    other = hub.handle(b"B", protocol.encode(Open(9, PROMPT, SamplingParams(), 4)))[0]
    assert isinstance(other, Opened)  # the quota is per target


async def test_draining_refuses_new_work_and_says_why(
    raw, running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    target = raw()
    await target.hello(llama_target)
    tag, _ = await target.open()
    running_hub.hub.table.draining = True
    for msg in (Open(5, PROMPT, SamplingParams(), 4), Draft(tag, 1, 0, PROMPT[:1])):
        reply = await target.ask(msg)
        assert isinstance(reply, Error) and reply.code == ErrorCode.SHUTTING_DOWN


def test_fair_queue_serves_targets_in_turn() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(6):
        q.put("chatty", f"c{i}")
    q.put("quiet", "q0")
    q.put("other", "o0")
    assert q.take(4) == ["c0", "q0", "o0", "c1"]  # one per target, in turn
    assert q.take(10) == ["c2", "c3", "c4", "c5"]
    q.close()
    assert q.take(1) is None


def test_fair_queue_wakes_sleeping_takers_for_every_job_and_on_close() -> None:
    """Takers asleep on the doorbell get every job exactly once, however puts and takes
    interleave, and close() wakes all of them (a lost wake-up fails the deadline)."""
    q: FairQueue[int] = FairQueue()
    taken: list[int] = []
    guard = threading.Lock()

    def taker() -> None:
        while (batch := q.take(3)) is not None:
            with guard:
                taken.extend(batch)

    # daemon: a lost wake-up must fail the test, not hang the run
    takers = [threading.Thread(target=taker, daemon=True) for _ in range(3)]
    for thread in takers:
        thread.start()
    for i in range(2000):
        q.put(i % 7, i)
        if i % 50 == 0:
            time.sleep(0.001)  # let the takers fall asleep between bursts
    deadline = time.monotonic() + 10
    while len(taken) < 2000 and time.monotonic() < deadline:
        time.sleep(0.01)
    q.close()
    for thread in takers:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in takers)
    assert sorted(taken) == list(range(2000))


# ---------------------------------------------------------------------- fuzz


def _valid_messages(target: models.LoadedModel) -> list[protocol.Message]:
    tag = b"\x01" * protocol.TAG_BYTES
    return [
        Hello("t", target.vocab_size, target.tokenizer_fingerprint),
        Open(1, PROMPT, SamplingParams(), 4),
        Open(2, PROMPT, SamplingParams(0.8, 5, 0.9, 3), 2),
        Draft(tag, 1, 0, PROMPT[:2]),
        Close(tag),
        Ping(3),
        StatsRequest(4),
    ]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = [bytearray(f) for f in frames]
    for _ in range(rng.randint(1, 4)):
        f = frames[rng.randrange(len(frames))]
        op = rng.randrange(4)
        if op == 0 and f:
            f[rng.randrange(len(f))] = rng.randrange(256)
        elif op == 1:
            del f[rng.randrange(len(f) + 1) :]
        elif op == 2:
            f[rng.randrange(len(f) + 1) : 0] = rng.randbytes(rng.randint(1, 16))
        else:
            frames.append(bytearray(rng.randbytes(rng.randint(0, 64))))
    return [bytes(f) for f in frames]


def _assert_sane(hub: hub_module.Hub, replies: list[protocol.Message]) -> None:
    for reply in replies:
        assert not (isinstance(reply, Error) and reply.code == ErrorCode.INTERNAL), reply
        protocol.decode(protocol.encode(reply))  # every reply is itself a valid message
    assert len(hub.table.peers) <= 1 and len(hub.sessions) <= hub.config.max_sessions_per_target


@pytest.fixture(scope="module")
def fuzz_hub(llama_pair: tuple[Path, Path]) -> hub_module.Hub:
    return hub_module.build_hub(hub_module.HubConfig(model=str(llama_pair[1])))


def test_fuzz_mutated_messages(fuzz_hub: hub_module.Hub, llama_target: models.LoadedModel) -> None:
    rng = random.Random(1234)
    valid = [protocol.encode(m) for m in _valid_messages(llama_target)]
    valid = [[bytes(f) for f in frames] for frames in valid]
    tracemalloc.start()
    try:
        for _ in range(10_000):
            frames = _mutate(rng, rng.choice(valid))
            _assert_sane(fuzz_hub, fuzz_hub.handle(b"fuzz", frames))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # bounded: nothing is allocated for what is refused
    ok = fuzz_hub.handle(b"fuzz", protocol.encode(Ping(99)))
    assert isinstance(ok[0], Pong) and ok[0].nonce == 99


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = [
    "ref",
    "tag",
    "seq",
    "accepted",
    "gamma",
    "sampling",
    "nonce",
    "arrays",
    "model",
    "vocab_size",
    "tokenizer",
    "version",
    "prompt",
    "appended",
]


@settings(
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.integers(0, 20),
    body=st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=6),
    arrays=st.lists(st.binary(max_size=64), max_size=3),
)
def test_fuzz_structured_bodies(
    fuzz_hub: hub_module.Hub, kind: int, body: dict, arrays: list[bytes]
) -> None:
    import msgpack

    header = bytes((protocol.PROTOCOL_VERSION, kind)) + msgpack.packb(body, use_bin_type=True)
    _assert_sane(fuzz_hub, fuzz_hub.handle(b"fuzz", [header, *arrays]))


async def test_socket_burst_of_garbage_then_service(
    raw, running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    rng = random.Random(7)
    valid = [[bytes(f) for f in protocol.encode(m)] for m in _valid_messages(llama_target)]
    attacker, bystander = raw(), raw()
    await bystander.hello(llama_target)
    tag, _ = await bystander.open()
    for _ in range(2000):
        await attacker.send_frames(_mutate(rng, rng.choice(valid)))
    await asyncio.sleep(0.2)
    reply = await bystander.ask(Draft(tag, 1, 0, PROMPT[:1]))
    assert isinstance(reply, Proposal) and reply.seq == 1


async def test_connect_survives_a_welcome_slower_than_the_rejoin_timer() -> None:
    """The liveness loop re-sends HELLO while connect() waits; either HELLO's WELCOME ends both.

    A loaded hub once took longer than the first heartbeat to answer 128 HELLOs at once: the
    re-sent HELLO replaced the future connect() waited on, which then timed out although the
    hub had answered.
    """
    ctx = transport.new_context()
    hub = ctx.socket(zmq.ROUTER)
    hub.setsockopt(zmq.LINGER, 0)
    port = hub.bind_to_random_port("tcp://127.0.0.1")
    welcome = Welcome("draft", 64, "tok", b"\x07" * 8, 4, 8)

    async def slow_hub() -> int:
        hellos = 0
        while hellos < 2:  # answer only after the client's rejoin timer has re-sent HELLO
            peer, *frames = await hub.recv_multipart()
            hellos += isinstance(protocol.decode(frames), Hello)
        for _ in range(hellos):
            await hub.send_multipart([peer, *protocol.encode(welcome)])
        return hellos

    client = HubClient(ctx, f"tcp://127.0.0.1:{port}", TargetInfo("t", 64, "tok"))
    try:
        answered, got = await asyncio.gather(slow_hub(), client.connect(timeout=5.0))
        assert answered == 2 and got == welcome
        assert client.up and client.generation == 1  # one WELCOME taken once
    finally:
        await client.aclose()
        hub.close()
        ctx.term()


def test_fair_queue_remove_and_clear() -> None:
    """Catches: a closed session's job still drafted (remove), a removal that reorders or
    loses other targets' jobs, and a drain that drafts its whole backlog (clear)."""
    q: FairQueue[str] = FairQueue()
    for owner, job in (("A", "a1"), ("B", "b1"), ("A", "a2"), ("A", "a3"), ("B", "b2")):
        q.put(owner, job)
    assert q.remove("A", lambda j: j == "a2") == 1 and q.remove("C", lambda j: True) == 0
    assert q.take(10) == ["a1", "b1", "a3", "b2"]
    q.put("A", "a4"), q.put("B", "b3")
    assert q.remove("B", lambda j: True) == 1 and q.take(10) == ["a4"]
    q.put("A", "a5")
    assert q.clear() == 1
    q.close()
    assert q.take(10) is None
