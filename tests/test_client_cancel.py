"""A sequence that is cancelled (an HTTP client that disconnects) always closes its hub session.

Two moments lost the tag, and the session stayed on the hub until the target's lease ran out (for
good, while the target lived): an open() cancelled after its OPENED reached the inbox but before
open() returned; and a sequence ended while its proposal was in the model thread (the verifier
then refuses the finished sequence, and that round dropped the session unclosed).
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import RunningHub

from edge import client as client_module
from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.client import HubClient
from edge.handshake import TargetInfo
from edge.speculate import Fallback, generate_speculative
from edge.verifier import TargetSequence
from starsd import models, protocol, transport
from starsd.protocol import Close, Opened, SamplingParams


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_an_opened_nobody_claims_is_closed(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug caught: a session opened on the hub for a sequence that no longer exists."""
    sent: list[protocol.Message] = []

    async def send(sock: object, msg: protocol.Message) -> None:
        sent.append(msg)

    def send_nowait(sock: object, msg: protocol.Message) -> bool:
        sent.append(msg)
        return True

    monkeypatch.setattr(client_module.transport, "send", send)
    monkeypatch.setattr(client_module.transport, "send_nowait", send_nowait)
    ctx = transport.new_context()
    client = HubClient(ctx, "tcp://127.0.0.1:1", TargetInfo("t", 8, "f"))
    try:
        timeout = 0.05 if how == "timed out" else 10.0
        task = asyncio.create_task(client.open([1, 2], SamplingParams(), 4, timeout))
        while not sent:  # the OPEN is out; its reply comes now
            await asyncio.sleep(0)
        tag = b"\x07" * protocol.TAG_BYTES
        if how == "cancelled":
            client._dispatch(Opened(ref=sent[0].ref, tag=tag))  # type: ignore[attr-defined]
            task.cancel()  # before open() could take the reply from its inbox
        else:  # the reply reaches the inbox in the very turn the timeout fires
            loop = asyncio.get_running_loop()
            loop.call_later(timeout, client._dispatch, Opened(ref=sent[0].ref, tag=tag))  # type: ignore[attr-defined]
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.01)  # the Close goes out via _send_soon
        closes = [m for m in sent if isinstance(m, Close)]
        if not task.cancelled() and task.exception() is None:
            # Python 3.11's wait_for returns a reply that was ready when the cancel (or the
            # timeout) came: the caller then owns the session and closes it itself.
            assert task.result()[0] == tag and not closes
            return
        assert closes == [Close(tag)]
        assert not client._routes.known(tag)
    finally:
        await client.aclose()
        ctx.term()


async def test_a_sequence_ended_during_its_verification_closes_its_session(
    running_hub: RunningHub, llama_target: models.LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught: a round whose verification the model thread refused because the sequence
    had ended meanwhile (Generation.cancel marks it done; Python 3.11's wait_for can drop the
    cancel itself) returned no session, so nothing closed it."""
    verify = Batcher.verify

    async def ended_meanwhile(self: Batcher, seq: TargetSequence, *args: object) -> object:
        seq.done = True  # as Generation.cancel does
        return await verify(self, seq, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Batcher, "verify", ended_meanwhile)
    ctx = transport.new_context()
    info = TargetInfo("t", llama_target.vocab_size, llama_target.tokenizer_fingerprint)
    client = HubClient(ctx, running_hub.endpoint, info)
    await client.connect()
    prompt = [3, 7, 11, 13]
    seq = TargetSequence(TorchBackend(llama_target), prompt, SamplingParams(), 30)
    try:
        async with Batcher(seq.backend) as batcher:
            await batcher.prefill(seq)
            await generate_speculative(client, seq, 4, batcher, Fallback(deadline_s=5.0))
        assert seq.stats.rounds == 0  # the one round was refused, as the cancel would have it
        assert (await client.stats()).sessions == 0
    finally:
        await client.aclose()
        ctx.term()


async def test_closing_a_client_ends_a_task_that_dropped_its_cancel() -> None:
    """Catches aclose() waiting for good on a background task that ran on after its cancel:
    Python 3.11's wait_for drops a cancel that lands as the future it waits on completes, as
    the liveness loop's re-join did when a hub's WELCOME came back at that moment (a test of
    two hubs hung until its 300 s timeout)."""
    ctx = transport.new_context()
    client = HubClient(ctx, "tcp://127.0.0.1:1", TargetInfo("t", 8, "f"))
    client.heartbeat_s = 0.01
    dropped = []

    async def rejoin_dropping_one_cancel() -> None:
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            if dropped:
                raise
            dropped.append(True)  # as wait_for returns the WELCOME instead of raising

    client._try_rejoin = rejoin_dropping_one_cancel  # type: ignore[method-assign]
    client._tasks = [asyncio.create_task(client._liveness_loop())]  # down: it re-joins
    await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(client.aclose(), 5.0)
    finally:
        client._tasks[0].cancel()  # (on a failure: what aclose did not end)
        client.sock.close(linger=0)
        ctx.term()
    assert dropped and client._tasks[0].cancelled()
