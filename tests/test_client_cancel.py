"""edge.client: an open() cancelled just as its OPENED arrives still closes that session.

An HTTP client that disconnects cancels its sequence; if the cancel lands after the OPENED was
routed to the inbox but before open() returned, the tag was lost and the session stayed on the
hub until the target's lease ran out.
"""

from __future__ import annotations

import asyncio

import pytest

from edge import client as client_module
from edge.client import HubClient
from edge.handshake import TargetInfo
from starsd import protocol, transport
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
        assert tag not in client._waiting
    finally:
        await client.aclose()
        ctx.term()
