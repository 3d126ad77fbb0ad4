"""What ``python -m edge.target`` is told: :class:`TargetConfig` and the command line that
fills it (:func:`parse_args`, every flag checked before anything loads)."""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from edge.backends import BACKENDS
from edge.hubs import parse_hub_endpoints
from edge.speculate import Fallback
from starsd import curve_client, limits, models, protocol
from starsd.protocol import SamplingParams

PROG = "python -m edge.target"
DESCRIPTION = "A StarSD target verifier (p side), also the standalone baseline."


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


def parse_args(argv: list[str] | None = None) -> TargetConfig:
    """argparse -> TargetConfig."""
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    p.add_argument(
        "--hub",
        default=TargetConfig.hub,
        help="hub endpoint(s), tcp://HOST:PORT[,tcp://HOST2:PORT...]: each new "
        "sequence goes to the live hub holding the fewest sessions",
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
