"""The HTTP edges of a target and a hub: text that is not Unicode, shutdown with streams in flight,
connections that never finish a request, on both the target's server and the hub's metrics port.

In process, on random loopback ports, with the timeouts shortened; every test is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from test_serve import _serving

from edge import serve
from edge.backends.torch import TorchBackend
from starsd import models
from starsd.hub import metrics as hub_metrics


async def test_a_lone_surrogate_is_a_400_naming_the_field_and_one_log_line(
    llama_target: models.LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches the tokenizer's TypeError becoming a 500 with a 65-line traceback per request.
    bodies = [
        b'{"model": "llama-target", "prompt": "a \\ud800 b", "max_tokens": 4}',
        b'{"model": "llama-target", "prompt": "ok", "stop": ["\\udfff"], "max_tokens": 4}',
    ]
    async with _serving(llama_target) as running, httpx.AsyncClient(timeout=30) as h:
        caplog.clear()
        for body, field in zip(bodies, ("prompt", "stop[0]"), strict=True):
            r = await h.post(
                f"{running.url}/v1/completions",
                content=body,
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field
        ok = await h.post(
            f"{running.url}/v1/completions",
            json={"model": "llama-target", "prompt": "To be", "max_tokens": 4},
        )
        assert ok.status_code == 200  # and it keeps serving
    ours = [r for r in caplog.records if r.name.startswith(("edge", "starsd", "uvicorn"))]
    assert not [r for r in ours if r.levelno >= logging.ERROR]
    assert not any(r.exc_info or "Traceback" in r.getMessage() for r in ours)


async def _stream(url: str, max_tokens: int) -> tuple[list[dict], bool]:
    """A streamed completion's events and whether it ended with ``[DONE]``."""
    events, done = [], False
    body = {"model": "llama-target", "prompt": "To be", "max_tokens": max_tokens, "stream": True}
    async with (
        httpx.AsyncClient(timeout=60) as h,
        h.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events, done


async def test_shutdown_ends_every_stream_with_a_finish_or_an_error_event(
    llama_target: models.LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches the review's SIGTERM with 8 streams (4 running, 4 queued): the queued ones were
    # cut after the grace period with no error event and no [DONE], text that looks complete.
    forward = TorchBackend.forward

    def slow(self: TorchBackend, *args: object, **kwargs: object) -> object:
        time.sleep(0.02)  # 220 tokens take seconds: none can finish within the grace
        return forward(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchBackend, "forward", slow)
    async with _serving(llama_target, concurrency=4, shutdown_grace_s=0.5) as running:
        streams = [asyncio.create_task(_stream(running.url, 220)) for _ in range(8)]
        while running.server.requests.running < 4:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        running.uvicorn.should_exit = True  # what SIGTERM sets
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
    for events, done in results:
        assert done, events
        last = events[-1]
        error = last.get("error")
        assert error is not None and error["code"] == "shutting_down", last
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))


async def test_shutdown_lets_running_requests_finish_within_the_grace(
    llama_target: models.LoadedModel,
) -> None:
    async with _serving(llama_target, concurrency=2, shutdown_grace_s=20) as running:
        streams = [asyncio.create_task(_stream(running.url, 8)) for _ in range(2)]
        while running.server.requests.running < 2:
            await asyncio.sleep(0.01)
        running.uvicorn.should_exit = True
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
    for events, done in results:
        assert done and events[-1]["choices"][0]["finish_reason"] == "length", events[-1]


def _idle_sockets(port: int, count: int, send: bytes = b"") -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        if send:
            sock.sendall(send)
        socks.append(sock)
    return socks


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except (TimeoutError, OSError) as exc:
        return not isinstance(exc, TimeoutError)
    finally:
        sock.close()


async def test_half_open_http_connections_are_closed_and_capped(
    llama_target: models.LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches uvicorn holding a connection that never completes its headers for good (3,000
    # stayed 31 s in the review): closed after the header timeout, and past the cap at once.
    monkeypatch.setattr(serve, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(serve, "MAX_CONNECTIONS", 20)
    async with _serving(llama_target) as running:
        port = int(running.url.rsplit(":", 1)[1])
        idle = await asyncio.to_thread(_idle_sockets, port, 10)
        partial = await asyncio.to_thread(_idle_sockets, port, 10, b"POST /v1/completions HT")
        extra = await asyncio.to_thread(_idle_sockets, port, 5)
        closed = await asyncio.gather(
            *(asyncio.to_thread(_closed_by_peer, s, 3.0) for s in idle + partial + extra)
        )
        assert all(closed), closed
        async with httpx.AsyncClient(timeout=10) as h:  # and a real client is still served
            assert (await h.get(f"{running.url}/health")).status_code == 200


def test_the_hub_metrics_port_bounds_idle_connections_and_threads(
    running_hub_sync: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches prometheus_client's server holding one OS thread per idle connection, forever
    # (9 -> 398 threads in the review).
    monkeypatch.setattr(hub_metrics._ScrapeHandler, "timeout", 0.5)
    exporter = hub_metrics.serve_metrics(running_hub_sync, "127.0.0.1", 0)  # type: ignore[arg-type]
    try:
        before = threading.active_count()
        idle = _idle_sockets(exporter.port, 60)
        time.sleep(0.2)
        assert threading.active_count() - before <= hub_metrics.MAX_SCRAPERS
        assert all(_closed_by_peer(s, 3.0) for s in idle)
        text = httpx.get(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).text
        assert "starsd:hub_sessions" in text
    finally:
        exporter.close()


@pytest.fixture
def running_hub_sync(llama_pair: tuple) -> object:
    """A hub object (not serving: the collector reads its tables only)."""
    from starsd import hub as hub_module

    config = hub_module.HubConfig(model=str(llama_pair[1]), bind="tcp://127.0.0.1:*")
    return hub_module.build_hub(config)
