"""A StarSD target verifier (p side), also the standalone baseline.

    python -m edge.target --hub tcp://HOST:5555 --model DIR --prompt TEXT [--max-new-tokens N]
    python -m edge.target --hub tcp://HOST:5555 --prompts IN.jsonl --out OUT.jsonl --concurrency K
    python -m edge.target --standalone --prompt TEXT     # no hub: plain autoregressive decoding
    python -m edge.target --hub tcp://HOST:5555 --serve [--host 127.0.0.1] [--port 8000]
                                  # an OpenAI-compatible HTTP server (edge.serve), /metrics
    ... [--backend torch|onnxruntime] [--max-batch 32]  # model runtime; rows per batched forward

JSONL in: {"id": ..., "prompt": "...", "max_new_tokens": 32} (optional per line: "messages", a chat
rendered by the chat template, as --chat renders "prompt" as one user turn; "temperature",
"top_k", "top_p", "seed" override the command line; valid ranges: protocol.SamplingParams); out:
{"id", "prompt", "text", "token_ids" (generated ids only), "stats": {"rounds", "accepted",
"mean_accepted", "standalone_steps", "alone_steps", "tokens_per_s", "latency_ms"}}. Each
sequence verifies the hub's proposals in one target forward per round, or decodes the span the hub
asks it to decode alone; its output is exactly what the target alone would produce (greedy: token
for token). The sequences in flight share that forward: whatever work is pending when the model
thread is free runs as one ragged batch of up to --max-batch rows (edge/batcher.py), standalone
steps (--standalone --concurrency K) too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import ipaddress
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import zmq.asyncio

from edge.backends import BACKENDS, BackendUnavailable, load_backend
from edge.backends.base import VerifierBackend
from edge.batcher import Batcher, BatchStats
from edge.client import HubError, HubUnavailable
from edge.engine import Engine
from edge.hubs import HubPool, parse_hub_endpoints
from edge.speculate import Fallback
from edge.verifier import TargetSequence
from starsd import curve_client, limits, models, protocol, transport
from starsd.protocol import SamplingParams

if TYPE_CHECKING:
    from edge.generation import Job

log = logging.getLogger("edge.target")
PROG = "python -m edge.target"


@dataclass(frozen=True)
class TargetConfig:
    """Everything ``python -m edge.target`` is told."""

    model: str
    hub: str = "tcp://127.0.0.1:5555"
    prompt: str | None = None
    prompts: str | None = None
    out: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    gamma: int = 0  # 0 = the hub's choice (per round under its --gamma auto)
    concurrency: int = 1
    standalone: bool = False
    chat: bool = False  # each prompt is a user turn of a chat
    backend: str = BACKENDS[0]
    providers: str | None = None  # onnxruntime: e.g. "tensorrt,cuda,cpu" (default: that order)
    max_batch: int = 32  # rows per batched forward
    gather: bool = True  # a forward waits for the proposals due within one forward's time
    device: str = "cpu"
    dtype: str = "float32"
    forward: str = "auto"  # torch backend: "transformers" turns the plain-torch Llama forward off
    threads: int = 1
    deadline_ms: float = 500.0  # wait this long for a proposal, then decode a token alone
    # the hub's pre-drafted branches each session takes pushed per round (0: only asked-for
    # proposals): a verdict that matches one is verified at once, without a hub round trip
    push: int = 4
    resync_s: float = 5.0
    curve_secret: str | None = None
    hub_public_key: str | None = None
    # --serve: the OpenAI-compatible HTTP server (edge.serve)
    serve: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required (Bearer) when --host is not loopback
    max_queue: int = 64  # requests running + waiting; past it 429
    max_body_bytes: int = 1 << 20
    served_model_name: str | None = None  # default: the model directory's name
    shutdown_grace_s: float = 5.0  # on SIGTERM: time running requests get to finish

    @property
    def hubs(self) -> tuple[str, ...]:
        """The hub endpoints of ``--hub`` (ValueError on a bad list; parse_args checks it)."""
        return parse_hub_endpoints(self.hub)

    @property
    def curve(self) -> curve_client.CurveClientConfig | None:
        """The CURVE settings for the first hub (see :attr:`curves`)."""
        return self.curves[0]

    @property
    def curves(self) -> list[curve_client.CurveClientConfig | None]:
        """CURVE settings per hub: ``--hub-public-key`` names one key for every hub or one per
        hub, in ``--hub``'s order."""
        hubs = len(self.hubs)
        if self.curve_secret is None or self.hub_public_key is None:
            return [None] * hubs
        keys = [key.strip() for key in self.hub_public_key.split(",")]
        if len(keys) not in (1, hubs):
            raise ValueError(f"--hub-public-key names {len(keys)} keys for {hubs} hubs")
        secret, keys = Path(self.curve_secret), keys * (hubs // len(keys))
        return [curve_client.CurveClientConfig(secret, Path(key)) for key in keys]

    @property
    def fallback(self) -> Fallback:
        return Fallback(self.deadline_ms / 1e3, self.resync_s)


@dataclass(frozen=True)
class Request:
    """One line of the input JSONL (or the single --prompt).

    A line may override the command line's sampling with "temperature", "top_k", "top_p" and
    "seed"; ``sampling`` is then set.
    """

    id: Any
    prompt: str
    max_new_tokens: int
    sampling: SamplingParams | None = None
    prompt_ids: tuple[int, ...] | None = None  # already tokenized (the HTTP server's chat)
    messages: tuple[dict[str, str], ...] | None = None  # a chat: rendered by the chat template


@dataclass(frozen=True)
class Result:
    """One line of the output JSONL."""

    id: Any
    prompt: str
    text: str
    token_ids: list[int]
    stats: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)


# ---------------------------------------------------------------------- requests


def load_requests(config: TargetConfig) -> list[Request]:
    """The --prompt or the --prompts JSONL as requests; ValueError names the line at fault."""
    if config.prompt is not None:
        return [
            Request(
                0, config.prompt, config.max_new_tokens, messages=_chat(config, None, config.prompt)
            )
        ]
    assert config.prompts is not None
    requests = []
    for line_no, line in enumerate(Path(config.prompts).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError("needs a string 'prompt'")
            max_new = _row_number(row, "max_new_tokens", config.max_new_tokens, int)
            sampling = _row_sampling(row, config, line_no - 1)
            messages = _chat(config, row.get("messages"), row["prompt"])
        except (ValueError, protocol.ProtocolError) as exc:
            reason = exc.message if isinstance(exc, protocol.ProtocolError) else exc
            raise ValueError(f"{config.prompts}:{line_no}: {reason}") from None
        requests.append(
            Request(row.get("id", line_no - 1), row["prompt"], max_new, sampling, messages=messages)
        )
    return requests


def _chat(config: TargetConfig, messages: Any, prompt: str) -> tuple[dict[str, str], ...] | None:
    """A line's conversation: its own "messages", else (--chat) its prompt as one user turn."""
    if messages is None:
        return ({"role": "user", "content": prompt},) if config.chat else None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise ValueError("'messages' must be a list of {'role': str, 'content': str}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def render_chats(backend: VerifierBackend, requests: list[Request]) -> list[Request]:
    """Requests with a conversation get their prompt ids from the target's chat template;
    ValueError where the model has none (or the template refuses the conversation)."""
    render = getattr(backend, "chat_prompt_ids", None)  # a backend may have none
    if render is None and any(r.messages is not None for r in requests):
        raise ValueError(f"backend {type(backend).__name__} cannot render a chat")
    return [
        r
        if r.messages is None
        else dataclasses.replace(r, prompt_ids=tuple(render(list(r.messages))))  # type: ignore[misc]
        for r in requests
    ]


def _row_sampling(row: dict[str, Any], config: TargetConfig, index: int) -> SamplingParams | None:
    """The line's own sampling, validated (ProtocolError names the field and its valid range)."""
    if not {"temperature", "top_k", "top_p", "seed"} & set(row):
        return None
    params = SamplingParams(
        _row_number(row, "temperature", config.temperature, float),
        _row_number(row, "top_k", config.top_k, int),
        _row_number(row, "top_p", config.top_p, float),
        _row_number(row, "seed", config.seed + index, int),
    )
    params.validate()
    return params


def _row_number(row: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """``row[key]`` (or ``default``) as a ``kind``: a JSON number, integral where ``kind`` is int
    (50.0 is 50); ValueError otherwise (never a TypeError or OverflowError from a null, a string
    or a 1e400)."""
    value = row.get(key, default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{key} {value!r} is not {'an integer' if kind is int else 'a number'}")
    try:
        return kind(value)
    except OverflowError:
        raise ValueError(f"{key} {value!r} is out of range") from None


def new_sequence(
    backend: VerifierBackend,
    config: TargetConfig,
    request: Request,
    index: int,
    taps: tuple[int, ...] = (),
) -> TargetSequence:
    """A fresh sequence for ``request``, not prefilled yet (:meth:`Engine.run` batches that);
    seeds differ per request but not per run. ``taps`` keeps the target's features for an
    EAGLE hub (from the first position on, so the sequence can be re-opened on a hub at any
    point): :meth:`Engine.feature_taps` says which."""
    params = request.sampling or SamplingParams(
        config.temperature, config.top_k, config.top_p, config.seed + index
    )
    prompt = list(request.prompt_ids or backend.encode(request.prompt))
    return TargetSequence(backend, prompt, params, request.max_new_tokens, taps, prefill=False)


def to_result(backend: VerifierBackend, request: Request, seq: TargetSequence) -> Result:
    stats = seq.stats.as_dict(len(seq.generated))
    text = backend.decode(seq.generated)
    return Result(request.id, request.prompt, text, list(seq.generated), stats)


# ---------------------------------------------------------------------- entry point


async def run_with_hub(
    config: TargetConfig,
    backend: VerifierBackend,
    requests: list[Request],
    stats: BatchStats | None = None,
) -> list[Result]:
    """Connect, run every request with ``concurrency`` sequences in flight, disconnect.
    ``stats`` (if given) receives the batcher's figures."""
    ctx = transport.new_context()
    hubs = hub_pool(ctx, config, backend)
    try:
        try:
            await hubs.connect()
        except HubUnavailable as exc:  # decode alone; the clients keep trying to reach the hubs
            log.warning("%s: starting without a hub", exc)
        return await _run_all(config, backend, requests, hubs, stats)
    finally:
        await hubs.aclose()
        ctx.term()


def hub_pool(ctx: zmq.asyncio.Context, config: TargetConfig, backend: VerifierBackend) -> HubPool:
    """One client per ``--hub`` endpoint (not connected yet)."""
    return HubPool.for_model(ctx, config.hubs, backend.info, config.push, config.curves)


async def run_standalone(
    config: TargetConfig,
    backend: VerifierBackend,
    requests: list[Request],
    stats: BatchStats | None = None,
) -> list[Result]:
    """The baseline: every request decoded by the target alone, ``concurrency`` at a time, their
    steps batched."""
    return await _run_all(config, backend, requests, None, stats)


async def _run_all(
    config: TargetConfig,
    backend: VerifierBackend,
    requests: list[Request],
    client: HubPool | None,
    stats: BatchStats | None,
) -> list[Result]:
    """Every request through one engine, ``concurrency`` sequences in flight."""
    limit = asyncio.Semaphore(config.concurrency)
    async with Batcher(backend, config.max_batch, stats=stats, gather=config.gather) as batcher:
        engine = Engine(backend, batcher, client, config.gamma, config.fallback)
        log.info(
            "verifying with the %s backend, up to %d rows per forward, %d sequences in flight",
            getattr(backend, "name", type(backend).__name__),
            config.max_batch,
            config.concurrency,
        )

        bar = _progress(config, len(requests))

        async def one(index: int, request: Request) -> Result:
            async with limit:
                seq = new_sequence(backend, config, request, index, engine.feature_taps())
                await engine.run(seq)
                _log_sequence(request, seq)
                bar.update(1)
                return to_result(backend, request, seq)

        try:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
        finally:
            bar.close()


def _progress(config: TargetConfig, total: int) -> Any:
    """A tqdm bar over --prompts on a terminal (stderr); a silent one otherwise."""
    from tqdm import tqdm

    quiet = config.prompts is None or not sys.stderr.isatty()
    return tqdm(total=total, unit="seq", disable=quiet, file=sys.stderr)


def _log_sequence(request: Request, seq: TargetSequence) -> None:
    s = seq.stats.as_dict(len(seq.generated))
    log.info(
        "sequence %s: %d tokens, %d rounds, mean_accepted %.2f, %.1f tok/s",
        request.id,
        len(seq.generated),
        s["rounds"],
        s["mean_accepted"],
        s["tokens_per_s"],
    )


def _log_summary(results: list[Result], wall: float, batches: BatchStats) -> None:
    tokens = sum(len(r.token_ids) for r in results)
    rounds = sum(int(r.stats["rounds"]) for r in results)
    accepted = sum(int(r.stats["accepted"]) for r in results)
    log.info(
        "done: %d sequences, %d tokens in %.2f s (%.1f tok/s), mean_accepted %.2f, "
        "%d forwards, mean rows per forward %.2f (max %d)",
        len(results),
        tokens,
        wall,
        tokens / max(wall, 1e-9),
        accepted / rounds if rounds else 0.0,
        batches.forwards,
        batches.mean_rows,
        batches.max_rows,
    )


def parse_args(argv: list[str] | None = None) -> TargetConfig:
    """argparse -> TargetConfig."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument(
        "--hub",
        default=TargetConfig.hub,
        help="hub endpoint(s), tcp://HOST:PORT[,tcp://HOST2:PORT...]: each new "
        "sequence goes to the live hub with the most room",
    )
    p.add_argument("--model", help="target model dir (default: the target of --pair)")
    p.add_argument(
        "--pair",
        default=models.DEFAULT_PAIR,
        choices=sorted(models.PAIRS),
        help="the project's model pair whose target is the default: smollm2 "
        "(SmolLM2-135M-Instruct, made by make install) or toy (the committed 3.5M pair)",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt; its completion is printed")
    source.add_argument("--prompts", help="JSONL file of requests")
    source.add_argument(
        "--serve",
        action="store_true",
        help="serve the OpenAI API over HTTP (see README 'Serve it')",
    )
    p.add_argument("--out", help="JSONL results (default: stdout)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user turn, rendered by the target's chat template (a JSONL "
        "line may instead carry its own 'messages')",
    )
    p.add_argument("--max-new-tokens", type=int, default=TargetConfig.max_new_tokens)
    p.add_argument("--temperature", type=float, default=TargetConfig.temperature)
    p.add_argument("--top-k", type=int, default=TargetConfig.top_k)
    p.add_argument("--top-p", type=float, default=TargetConfig.top_p)
    p.add_argument("--seed", type=int, default=TargetConfig.seed)
    p.add_argument(
        "--gamma",
        type=int,
        default=TargetConfig.gamma,
        help="0: the hub's choice (per round under --gamma auto); N: always N",
    )
    p.add_argument("--concurrency", type=int, default=TargetConfig.concurrency)
    p.add_argument("--standalone", action="store_true", help="no hub: the baseline")
    _runtime_arguments(p)
    p.add_argument(
        "--deadline-ms",
        type=float,
        default=TargetConfig.deadline_ms,
        help="longest wait for a proposal before decoding a token without the hub",
    )
    p.add_argument(
        "--resync-s",
        type=float,
        default=TargetConfig.resync_s,
        help="re-open a hub session silent for this long",
    )
    p.add_argument(
        "--push",
        type=int,
        default=TargetConfig.push,
        help="branches the hub pre-drafts that each session takes pushed ahead of "
        f"its verdict (0..{limits.MAX_PUSH}; 0: none)",
    )
    p.add_argument("--curve-secret", help="this target's key pair (starsd keys generate)")
    p.add_argument(
        "--hub-public-key",
        help="the hub's public .key file (several hubs: one for all, or one per "
        "hub, comma separated)",
    )
    _serve_arguments(p)
    args = p.parse_args(argv)
    pair = args.__dict__.pop("pair")
    args.model = args.model or str(models.PAIRS[pair][0])
    config = TargetConfig(**vars(args))
    if (config.curve_secret is None) != (config.hub_public_key is None):
        p.error("--curve-secret and --hub-public-key go together")
    try:
        config.curves  # noqa: B018 (checks the hub list and its keys)
    except ValueError as exc:
        p.error(f"--hub: {exc}")
    try:
        SamplingParams(config.temperature, config.top_k, config.top_p, config.seed).validate()
    except protocol.ProtocolError as exc:
        p.error(exc.message)
    if config.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if not 0 <= config.push <= limits.MAX_PUSH:
        p.error(f"--push must be in 0..{limits.MAX_PUSH}, got {config.push}")
    _check_runtime(p, config)
    if config.serve:
        _check_serve(p, config)
    return config


def _runtime_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model runtime")
    g.add_argument(
        "--backend",
        default=TargetConfig.backend,
        choices=BACKENDS,
        help="model runtime (onnxruntime: an export made by python -m edge.export)",
    )
    g.add_argument(
        "--providers",
        help="onnxruntime: execution providers to try, in order "
        "(default tensorrt,cuda,cpu: those this build has)",
    )
    g.add_argument(
        "--max-batch",
        type=int,
        default=TargetConfig.max_batch,
        help="most sequences verified (or stepped) in one forward",
    )
    g.add_argument(
        "--gather",
        action=argparse.BooleanOptionalAction,
        default=TargetConfig.gather,
        help="before a forward, wait (at most one forward's time) for the "
        "proposals due back from the hub by then: one forward for all of them",
    )
    g.add_argument("--device", default=TargetConfig.device)
    g.add_argument("--dtype", default=TargetConfig.dtype, choices=sorted(models.DTYPES))
    g.add_argument(
        "--forward",
        default=TargetConfig.forward,
        choices=models.FORWARDS,
        help="torch backend: auto runs a plain Llama through StarSD's plain-torch "
        "forward (starsd/llama.py); transformers: always transformers' own",
    )
    g.add_argument("--threads", type=int, default=TargetConfig.threads, help="torch threads")


def _check_runtime(p: argparse.ArgumentParser, config: TargetConfig) -> None:
    if config.max_batch < 1:
        p.error("--max-batch must be >= 1")
    if config.forward != "auto" and config.backend != "torch":
        p.error("--forward applies to the torch backend")
    if config.providers is not None and config.backend != "onnxruntime":
        p.error("--providers applies to --backend onnxruntime only")


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "--serve (an OpenAI-compatible HTTP server; --concurrency: sequences decoded at once)"
    )
    g.add_argument(
        "--host",
        default=TargetConfig.host,
        help="address to listen on (not loopback: --api-key required)",
    )
    g.add_argument("--port", type=int, default=TargetConfig.port)
    g.add_argument(
        "--api-key",
        default=os.environ.get("STARSD_API_KEY"),
        help="Bearer key the /v1 routes require (default: $STARSD_API_KEY)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=TargetConfig.max_queue,
        help="requests running + waiting; past it new ones get 429",
    )
    g.add_argument("--max-body-bytes", type=int, default=TargetConfig.max_body_bytes)
    g.add_argument(
        "--served-model-name",
        help="the model name clients use (default: the model directory's name)",
    )
    g.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=TargetConfig.shutdown_grace_s,
        help="on SIGTERM / SIGINT: how long running requests get to finish; those "
        "still running then (and those waiting) end with a 503 error event",
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") is only reachable from this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_serve(p: argparse.ArgumentParser, config: TargetConfig) -> None:
    if not is_loopback(config.host) and not config.api_key:
        p.error(
            f"--host {config.host} is not loopback: set --api-key (or $STARSD_API_KEY), "
            "and put TLS in front of it"
        )
    if config.max_queue < 1 or config.max_body_bytes < 1:
        p.error("--max-queue and --max-body-bytes must be >= 1")
    if not 0 <= config.shutdown_grace_s <= 3600:
        p.error("--shutdown-grace-s must be in [0, 3600]")


def write_results(config: TargetConfig, results: list[Result]) -> None:
    """JSONL to --out; a single --prompt without --out prints just its text."""
    if config.out:
        Path(config.out).write_text("".join(r.to_json() + "\n" for r in results))
    elif config.prompt is not None:
        print(results[0].text)
    else:
        sys.stdout.write("".join(r.to_json() + "\n" for r in results))


def job_sequence(
    backend: VerifierBackend, config: TargetConfig, job: Job, index: int, taps: tuple[int, ...]
) -> TargetSequence:
    """The sequence of an HTTP request (edge.serve): built as a --prompts line's is (not
    prefilled: the server's engine batches that)."""
    request = Request(None, "", job.max_tokens, job.params, prompt_ids=job.prompt_ids)
    return new_sequence(backend, config, request, index, taps)


def _serve(config: TargetConfig) -> int:
    from edge import serve  # fastapi, uvicorn, prometheus_client: only for --serve

    backend = open_backend(config)
    if backend is None:
        return 2
    return serve.main(config, backend, functools.partial(job_sequence, backend, config))


def open_backend(config: TargetConfig) -> VerifierBackend | None:
    """The target's backend (torch threads set first), or None once the error is printed."""
    torch.set_num_threads(config.threads)
    options: dict[str, Any] = {} if config.providers is None else {"providers": config.providers}
    if config.forward != "auto":
        options["forward"] = config.forward
    try:
        return load_backend(config.backend, config.model, config.device, config.dtype, **options)
    except (BackendUnavailable, ValueError, OSError) as exc:  # a missing model, a refused export...
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m edge.target``; returns the exit code."""
    logging.basicConfig(
        level=os.environ.get("STARSD_LOG", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = parse_args(argv)
    if config.serve:
        return _serve(config)
    try:  # a bad line is refused like a bad option: before loading any model
        requests = load_requests(config)
    except (OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    backend = open_backend(config)
    if backend is None:
        return 2
    try:
        requests = render_chats(backend, requests)
    except ValueError as exc:
        print(f"{PROG}: error: {config.model}: {exc}", file=sys.stderr)
        return 2
    started, batches = time.perf_counter(), BatchStats()
    run = run_standalone if config.standalone else run_with_hub
    try:
        results = transport.run_loop(run(config, backend, requests, batches))
    except (HubError, protocol.ProtocolError, curve_client.HandshakeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    _log_summary(results, time.perf_counter() - started, batches)
    write_results(config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
