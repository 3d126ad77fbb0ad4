"""``python -m edge.target --serve``: the OpenAI API over HTTP, and Prometheus metrics.

    POST /v1/completions, /v1/chat/completions   (streamed as server-sent events with "stream")
    GET  /v1/models, /health, /metrics

FastAPI on uvicorn, on the same event loop as the hub client (uvloop where installed); the model
runs in the target's one worker thread. Every request is a sequence in flight on the hub
(:mod:`edge.generation`); with the hub down it still completes, decoded alone.

Policy: the /v1 routes need ``Authorization: Bearer <--api-key>`` when a key is set, and a key is
required to listen anywhere but loopback (the server refuses to start otherwise; HTTP is plain
text, so put TLS in front of it); /health and /metrics are open, as in vLLM. A body over
``--max-body-bytes`` gets 413, a bad field 400 naming it, an unknown model 404, more than
``--max-queue`` requests running + waiting 429 with Retry-After. A client that disconnects
cancels its sequence, which closes its hub session.

Bounds on the HTTP side: a connection must complete a request's headers within
``HEADER_TIMEOUT_S`` of opening (or of its previous response) and at most ``MAX_CONNECTIONS``
are open at once; beyond either it is closed (a slow or half-open client cannot hold sockets and
memory). Shutdown (SIGTERM, SIGINT): new requests get 503, requests still waiting for a decoding
slot end at once, running ones get ``--shutdown-grace-s`` (default 5 s) to finish; a request
that cannot finish ends with a 503 error (streamed: an error event, then ``data: [DONE]``), never
with text that only looks complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from edge import openai_api as api
from edge.backends.base import VerifierBackend
from edge.generation import Delta, Generation, Job, NewSequence, RequestQueue, ServeConfig
from edge.handshake import HubError, HubUnavailable
from edge.hubs import HubPool
from edge.metrics import TargetMetrics
from edge.openai_api import ApiError
from starsd import curve_client, protocol, transport

log = logging.getLogger("edge.serve")
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
CONNECT_TIMEOUT_S = 2.0  # the first WELCOME; past it serve alone (the client keeps trying)
HEADER_TIMEOUT_S = 10.0  # a connection sends a request's headers within this, or is closed
MAX_CONNECTIONS = 512  # open HTTP connections; one more is closed at once
FLUSH_S = 2.0  # after the drain: time for the last events to reach their clients


class ServerConfig(ServeConfig, Protocol):
    """What the server reads of ``edge.target_config.TargetConfig`` (see :class:`ServeConfig`)."""

    @property
    def hub(self) -> str: ...
    @property
    def hubs(self) -> tuple[str, ...]: ...
    @property
    def curves(self) -> list[curve_client.CurveClientConfig | None]: ...
    @property
    def standalone(self) -> bool: ...
    @property
    def push(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def served_model_name(self) -> str | None: ...
    @property
    def shutdown_grace_s(self) -> float: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...


@dataclass
class Server:
    """What the routes share: the model, the request queue, the metrics, the policy."""

    config: ServerConfig
    target: VerifierBackend
    requests: RequestQueue
    metrics: TargetMetrics
    name: str
    defaults: api.Defaults
    served: dict[str, int] = field(
        default_factory=lambda: {"requests": 0, "tokens": 0, "rejected": 0}
    )

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(
                401,
                "missing or wrong API key (Authorization: Bearer ...)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_json(self, request: Request) -> Any:
        """The body as JSON, refused past the size limit before it is all read."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > limit:
            raise ApiError(413, f"the body is over {limit} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the body is over {limit} bytes", code="body_too_large")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server has {self.name!r}",
                "model",
                "model_not_found",
            )

    async def respond(
        self, request: Request, body: api.BaseRequest, prompt: list[int], chat: bool
    ) -> Response:
        """Validate the rest, admit (or 429), then stream or collect the generation."""
        vocab = self.target.info.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        limit = self.target.info.max_positions
        job = Job(
            tuple(prompt),
            api.sampling(body, self.defaults, None),
            api.max_tokens(body, self.defaults.max_tokens, len(prompt), limit),
            api.stops(body),
        )
        if self.requests.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.requests.full():
            raise ApiError(
                429,
                f"the server is busy ({self.requests.admitted} requests running or "
                "waiting); retry later",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        generation = self.requests.start(job)
        reply = api.Reply(self.name, chat)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self._sse(generation, reply, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(_cancel, generation),
            )
        return await self._collect(request, generation, reply)

    async def _sse(
        self, generation: Generation, reply: api.Reply, include_usage: bool
    ) -> AsyncIterator[str]:
        if reply.chat:
            yield _event(reply.chunk(None))
        try:
            async for delta in generation.events():
                if delta.text or delta.finish is None:
                    yield _event(reply.chunk(delta.text))
                if delta.finish is not None:
                    yield _event(reply.chunk("", delta.finish, delta.figures))
                    if include_usage:
                        yield _event(
                            reply.usage_chunk(self._usage(generation, delta), delta.figures or {})
                        )
                    self._log(reply, generation, delta)
        except Exception as exc:  # the status line is sent already: an error event instead
            yield _event(_api_error(exc).body())
        yield "data: [DONE]\n\n"

    async def _collect(
        self, request: Request, generation: Generation, reply: api.Reply
    ) -> Response:
        joined = asyncio.ensure_future(_join(generation))
        try:
            while not joined.done():
                await asyncio.wait({joined}, timeout=0.25)
                if not joined.done() and await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; decoding stops below
            text, final = joined.result()
        except Exception as exc:
            raise _api_error(exc) from exc
        finally:
            joined.cancel()
            generation.cancel()
        self._log(reply, generation, final)
        return JSONResponse(
            reply.full(
                text, final.finish or "stop", self._usage(generation, final), final.figures or {}
            )
        )

    def _usage(self, generation: Generation, final: Delta) -> dict[str, int]:
        return api.usage(len(generation.job.prompt_ids), final.completion_tokens)

    def _log(self, reply: api.Reply, generation: Generation, final: Delta) -> None:
        self.served["requests"] += 1
        self.served["tokens"] += final.completion_tokens
        f = final.figures or {}
        log.info(
            "%s: %d+%d tokens (%s) in %.0f ms, %d rounds, mean_accepted %.2f",
            reply.id,
            len(generation.job.prompt_ids),
            final.completion_tokens,
            final.finish,
            1e3 * (time.perf_counter() - generation.arrived),
            f.get("rounds", 0),
            f.get("mean_accepted", 0.0),
        )


def _api_error(exc: Exception) -> ApiError:
    """What a client is told of a request that failed: the server's own refusal (shutting
    down) as it is, anything else as a 500 naming only the exception's type."""
    if isinstance(exc, ApiError):
        return exc
    return ApiError(500, f"generation failed: {type(exc).__name__}")


async def _cancel(generation: Generation) -> None:
    """Stop a stream's decoding once its response ends (a client that went away). A coroutine
    so that Starlette runs it on the event loop: a plain function would run in its thread pool,
    and asyncio's tasks must not be cancelled from another thread."""
    generation.cancel()


async def _join(generation: Generation) -> tuple[str, Delta]:
    parts, final = [], Delta("")
    async for delta in generation.events():
        parts.append(delta.text)
        final = delta
    return "".join(parts), final


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(server: Server) -> FastAPI:
    """The HTTP routes over ``server``."""
    app = FastAPI(title="StarSD target", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _refused(request: Request, exc: ApiError) -> Response:
        if exc.status in (413, 429):
            server.served["rejected"] += 1
            server.metrics.rejected.labels(**server.metrics.labels, status=str(exc.status)).inc()
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:  # 404, 405 routes
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), exc.status_code)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        hubs = server.requests.client
        clients = hubs.clients if hubs is not None else []
        return {
            "status": "ok",
            "hub": hubs is not None and hubs.up,
            "hubs": {c.endpoint: c.up for c in clients},
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        server.requests.publish()  # the hub may have come or gone since the last request
        text, content_type = server.metrics.render()
        return Response(text, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        server.authorize(request)
        return {
            "object": "list",
            "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "starsd"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server.authorize(request)
        body = api.parse(api.CompletionRequest, await server.read_json(request))
        server.check_model(body.model)
        prompt = api.completion_prompt(body)
        ids = prompt if isinstance(prompt, list) else server.target.encode(prompt)
        return await server.respond(request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        server.authorize(request)
        body = api.parse(api.ChatRequest, await server.read_json(request))
        server.check_model(body.model)
        render = getattr(server.target, "chat_prompt_ids", None)  # a backend may have none
        if render is None or not server.target.has_chat_template():  # type: ignore[attr-defined]
            raise ApiError(
                400,
                f"model {server.name!r} has no chat template: use /v1/completions",
                "messages",
                "no_chat_template",
            )
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if not messages:
            raise ApiError(400, "messages must not be empty", "messages")
        try:
            ids = render(messages)
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from None
        return await server.respond(request, body, ids, chat=True)

    return app


# ---------------------------------------------------------------------- running it


class BoundedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the bounds it lacks: it times out a connection only
    after a response (keep-alive), so one that never completes its headers, or never sends a
    byte, was held for good (3,000 half-open connections stayed open in a test)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > MAX_CONNECTIONS:
            transport.close()
            return
        self._await_headers()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._stop_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

    def _stop_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = None

    def _headers_late(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the request queue before it waits for connections (see the module
    docstring): uvicorn alone would cut every stream at its graceful timeout, silently."""

    def __init__(self, config: uvicorn.Config, requests: RequestQueue, grace_s: float) -> None:
        super().__init__(config)
        self.requests, self.grace_s = requests, grace_s

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        for server in self.servers:  # no new connections while draining
            server.close()
        why = ApiError(503, "the server is shutting down", code="shutting_down")
        ended = await self.requests.drain(self.grace_s, why)
        if ended:
            log.info(
                "shutdown: %d requests could not finish within %.1f s and were ended with an error",
                ended,
                self.grace_s,
            )
        await super().shutdown(sockets)


@dataclass
class Serving:
    """A running server: its URL, and what stops it."""

    url: str
    server: Server
    uvicorn: DrainingServer
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def serving(
    config: ServerConfig, target: VerifierBackend, new_sequence: NewSequence
) -> AsyncIterator[Serving]:
    """Connect to the hub (unless --standalone), serve HTTP on the running loop until the
    context exits (or a signal stops uvicorn), then cancel what is in flight and disconnect."""
    ctx = transport.new_context()
    client = None if config.standalone else _hub_pool(ctx, config, target)
    name = config.served_model_name or target.info.name
    metrics = TargetMetrics(name)
    requests = RequestQueue(config, target, metrics, client, new_sequence)
    defaults = api.Defaults(config.max_new_tokens, config.temperature, config.top_k, config.top_p)
    server = Server(config, target, requests, metrics, name, defaults)
    uv_config = uvicorn.Config(
        create_app(server),
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,
        lifespan="off",
        http=BoundedH11,
        timeout_graceful_shutdown=int(FLUSH_S),
    )
    uv = DrainingServer(uv_config, requests, config.shutdown_grace_s)
    try:
        if client is not None:
            try:
                await client.connect(CONNECT_TIMEOUT_S)
            except HubUnavailable as exc:  # decode alone; the client keeps trying
                log.warning("%s: serving without the hub for now", exc)
        task = asyncio.create_task(uv.serve())
        while not uv.started:
            if task.done():  # e.g. the port is taken: uvicorn logs why and exits
                raise OSError(f"could not listen on {config.host}:{config.port}")
            await asyncio.sleep(0.01)
        host, port = uv.servers[0].sockets[0].getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        yield Serving(url, server, uv, task)
    finally:
        uv.should_exit = True
        if "task" in locals():
            await asyncio.gather(task, return_exceptions=True)
        await requests.aclose()
        if client is not None:
            await client.aclose()
        ctx.term()


def _hub_pool(ctx: Any, config: ServerConfig, target: VerifierBackend) -> HubPool:
    return HubPool.for_model(ctx, config.hubs, target.info, config.push, config.curves)


async def _serve_forever(
    config: ServerConfig, target: VerifierBackend, new_sequence: NewSequence
) -> None:
    # uvicorn takes SIGINT / SIGTERM while it serves, then restores the handlers it found and
    # raises the signal again: with these, that second raise is a no-op and the summary is logged.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    async with serving(config, target, new_sequence) as s:
        mode = "standalone" if config.standalone else f"hub {config.hub}"
        log.info(
            "serving %s on %s/v1 (%s, %d sequences at once, queue %d, %s)",
            s.server.name,
            s.url,
            mode,
            config.concurrency,
            config.max_queue,
            "API key required" if config.api_key else "no API key",
        )
        started = time.perf_counter()
        await s.task  # until SIGINT / SIGTERM (uvicorn handles them)
        served = s.server.served
        log.info(
            "stopped after %.0f s: %d requests, %d tokens, %d rejected",
            time.perf_counter() - started,
            served["requests"],
            served["tokens"],
            served["rejected"],
        )


def main(config: ServerConfig, target: VerifierBackend, new_sequence: NewSequence) -> int:
    """``python -m edge.target --serve`` once the model is loaded; returns the exit code."""
    try:
        transport.run_loop(_serve_forever(config, target, new_sequence))
    except (HubError, protocol.ProtocolError, curve_client.HandshakeError, OSError) as exc:
        log.error("%s", exc)
        return 2
    return 0
