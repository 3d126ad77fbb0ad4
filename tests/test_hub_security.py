"""The hub with CURVE + ZAP: who gets in, what sessions are bound to, revocation, spoofing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import PROMPT, RawTarget, RunningHub

from edge.client import HubClient
from edge.handshake import HubUnavailable, TargetInfo
from starsd import hub as hub_module
from starsd import models, protocol, transport
from starsd.curve_client import CurveClientConfig, HandshakeRejected
from starsd.keys import generate_keypair, load_keypair
from starsd.protocol import Draft, Open, Opened, Ping, Proposal, SamplingParams


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    for name in ("hub", "alice", "bob", "mallory"):
        generate_keypair(tmp_path / "keys", name)
    allow = tmp_path / "allow"
    allow.mkdir()
    for name in ("alice", "bob"):
        (allow / f"{name}.key").write_bytes((tmp_path / "keys" / f"{name}.key").read_bytes())
    return tmp_path


@pytest.fixture
async def curve_hub(keys: Path, llama_pair: tuple[Path, Path]) -> AsyncIterator[hub_module.Hub]:
    config = hub_module.HubConfig(
        model=str(llama_pair[1]),
        bind="tcp://127.0.0.1:*",
        curve_secret=str(keys / "keys" / "hub.key_secret"),
        allow_dir=str(keys / "allow"),
        stats_interval=3600,
    )
    hub = hub_module.build_hub(config)
    ctx = transport.new_context()
    task = asyncio.create_task(hub.serve(ctx))
    while not hub.endpoint:
        await asyncio.sleep(0.01)
    yield hub
    hub.stop()
    await asyncio.wait_for(task, 10)
    ctx.term()


def _client(
    hub: hub_module.Hub, keys: Path, name: str, target: models.LoadedModel, ctx: zmq.asyncio.Context
) -> HubClient:
    curve = CurveClientConfig(keys / "keys" / f"{name}.key_secret", keys / "keys" / "hub.key")
    info = TargetInfo(name, target.vocab_size, target.tokenizer_fingerprint)
    return HubClient(ctx, hub.endpoint, info, curve)


async def test_allowed_keys_get_in_and_sessions_are_bound_to_the_key(
    curve_hub: hub_module.Hub, keys: Path, llama_target: models.LoadedModel
) -> None:
    ctx = transport.new_context()
    alice, bob = (_client(curve_hub, keys, n, llama_target, ctx) for n in ("alice", "bob"))
    try:
        await alice.connect()
        await bob.connect()
        tag, inbox = await alice.open(PROMPT.tolist(), SamplingParams(), 4)
        assert isinstance(await inbox.get(), Proposal)
        alice_key = load_keypair(keys / "keys" / "alice.key_secret").public
        assert curve_hub.sessions[tag].owner == alice_key
        bob_tag, _ = await bob.open(PROMPT.tolist(), SamplingParams(), 4)
        # Bob names Alice's session: refused, nothing about it leaks or changes.
        state = curve_hub.sessions[tag].state
        before = (list(state.tokens), list(state.proposed))
        await bob.draft(tag, 1, 0, [3])
        await asyncio.sleep(0.2)
        assert (list(state.tokens), list(state.proposed)) == before
        assert bob_tag in curve_hub.sessions
    finally:
        await alice.aclose()
        await bob.aclose()
        ctx.term()


async def test_unknown_key_fails_loudly_and_never_reaches_the_hub(
    curve_hub: hub_module.Hub, keys: Path, llama_target: models.LoadedModel
) -> None:
    ctx = transport.new_context()
    mallory = _client(curve_hub, keys, "mallory", llama_target, ctx)
    started = time.monotonic()
    try:
        with pytest.raises(HandshakeRejected):
            await mallory.connect()
        assert time.monotonic() - started < 1.5
    finally:
        await mallory.aclose()
    plain = RawTarget(curve_hub.endpoint)  # no CURVE at all
    await plain.send(Ping(1))
    with pytest.raises(asyncio.TimeoutError):
        await plain.recv(timeout=0.5)
    plain.close()
    ctx.term()
    assert curve_hub.stats.messages == 0  # neither reached the application


async def test_a_revoked_key_is_refused_at_its_next_message(
    curve_hub: hub_module.Hub, keys: Path, llama_target: models.LoadedModel
) -> None:
    ctx = transport.new_context()
    bob = _client(curve_hub, keys, "bob", llama_target, ctx)
    try:
        await bob.connect()
        tag, inbox = await bob.open(PROMPT.tolist(), SamplingParams(), 4)
        assert isinstance(await inbox.get(), Proposal)
        (keys / "allow" / "bob.key").unlink()
        assert curve_hub.allow is not None and curve_hub.allow.reload()
        await bob.draft(tag, 1, 0, [3])
        for _ in range(50):  # the hub answers UNAUTHENTICATED; the client stops using it
            if not bob.up:
                break
            await asyncio.sleep(0.02)
        assert not bob.up
        assert tag not in curve_hub.sessions and curve_hub.stats.unauthenticated >= 1
        with pytest.raises(HubUnavailable):  # and it stays out
            await bob.open(PROMPT.tolist(), SamplingParams(), 4, timeout=0.5)
    finally:
        await bob.aclose()
        ctx.term()


async def test_a_spoofed_routing_id_cannot_receive_another_targets_proposals(
    raw, running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    victim = raw()
    await victim.hello(llama_target)
    tag, _ = await victim.open()
    victim_id = next(iter(running_hub.hub.table.peers))
    spoof_ctx = zmq.asyncio.Context()
    spoof = spoof_ctx.socket(zmq.DEALER)
    spoof.setsockopt(zmq.LINGER, 0)
    spoof.setsockopt(zmq.ROUTING_ID, victim_id)  # claims the victim's routing id
    spoof.connect(running_hub.endpoint)
    try:
        await transport.send(spoof, Draft(tag, 1, 0, np.array([3], dtype=np.int32)))
        await asyncio.sleep(0.3)
        assert await _nothing_or_no_proposal(spoof)
        # The victim's session was untouched: its own next round is served to it.
        reply = await victim.ask(Draft(tag, 1, 0, np.array([3], dtype=np.int32)))
        assert isinstance(reply, Proposal) and reply.seq == 1
        opened = await victim.ask(Open(7, PROMPT, SamplingParams(), 4))
        assert isinstance(opened, Opened)
    finally:
        spoof.close(linger=0)
        spoof_ctx.term()


async def _nothing_or_no_proposal(sock: zmq.asyncio.Socket) -> bool:
    try:
        msg = protocol.decode(await asyncio.wait_for(sock.recv_multipart(copy=False), 0.3))
    except asyncio.TimeoutError:
        return True
    return not isinstance(msg, Proposal)
