"""``python -m starsd.hub``: command line -> HubConfig, build the hub, run until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from starsd import keys, limits, models, protocol, transport
from starsd.hub import Hub, HubConfig, auth, build_hub, router
from starsd.hub.config import QUANTIZE_MODES
from starsd.hub.drafters import KINDS
from starsd.hub.shapes import TREE_MODES

log = logging.getLogger("starsd.hub")


def parse_args(argv: list[str] | None = None) -> HubConfig:
    """argparse -> HubConfig."""
    p = argparse.ArgumentParser(
        prog="python -m starsd.hub", description="StarSD draft hub: one ROUTER, many targets"
    )
    p.add_argument(
        "--model",
        help="draft model dir or hub id (default: the --pair's drafter of --draft-kind; "
        "without either, its default drafter: the EAGLE-3 head for smollm2)",
    )
    p.add_argument(
        "--pair",
        default=models.DEFAULT_PAIR,
        choices=sorted(models.PAIRS),
        help="the project's model pair whose draft (and, for --draft-kind eagle, target) is "
        "the default: smollm2 (SmolLM2-135M-Instruct, made by make install) or toy (the "
        "committed 3.5M/0.6M pair)",
    )
    p.add_argument("--bind", default=HubConfig.bind)
    p.add_argument(
        "--gamma",
        type=_gamma,
        default=HubConfig.gamma,
        help="draft tokens per round: auto (default) chooses per session and round "
        "from its acceptance and the hub's load (0 when speculation does not "
        "pay: the target decodes alone for a while); N in 0..--max-gamma fixes "
        "it. An OPEN naming a gamma keeps its own",
    )
    p.add_argument("--max-gamma", type=int, default=HubConfig.max_gamma)
    p.add_argument("--device", default=HubConfig.device, help="cpu, cuda, cuda:1, ...")
    _add_precision_args(p)
    p.add_argument(
        "--forward",
        default=HubConfig.forward,
        choices=models.FORWARDS,
        help="auto: a plain Llama runs StarSD's plain-torch forward (starsd/llama.py); "
        "transformers: always transformers' own",
    )
    p.add_argument("--max-sessions", type=int, default=HubConfig.max_sessions)
    p.add_argument("--max-sessions-per-target", type=int, default=HubConfig.max_sessions_per_target)
    p.add_argument("--threads", type=int, default=HubConfig.threads, help="torch threads")
    p.add_argument("--stats-interval", type=float, default=HubConfig.stats_interval)
    p.add_argument(
        "--draft-kind",
        default=None,
        choices=KINDS,
        help="(default: the --pair's default drafter, or llm with --model) "
        "llm: a draft causal LM (--model); eagle: an EAGLE-1 head (--model) on "
        "the target's embedding and LM head (--target); eagle3: an EAGLE-3 head (--model, "
        "EAGLE's or speculators' layout) for --target; null: no model work; emulated: no "
        "model work, each batch taking S(B, g) of --draft-profile (--model: its tokenizer)",
    )
    p.add_argument(
        "--draft-profile",
        help="emulated: a draft profile (starsd profile draft) whose S(B, g) the hub replays",
    )
    p.add_argument(
        "--target",
        help="eagle, eagle3: the target model directory (default: the pair's target)",
    )
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=HubConfig.heartbeat_s,
        help="liveness interval; a target silent for "
        f"{protocol.LIVENESS_INTERVALS} intervals is freed",
    )
    p.add_argument("--drain-timeout-s", type=float, default=HubConfig.drain_timeout_s)
    p.add_argument("--curve-secret", help="the hub's key pair (starsd keys generate)")
    p.add_argument("--allow-dir", help="directory of allowed targets' public .key files")
    p.add_argument(
        "--peer-budget",
        type=float,
        default=HubConfig.peer_budget,
        help="messages per second a connection may send besides accepted DRAFTs, "
        "plus as many per session it holds (5 s of burst); the excess is "
        "dropped unread. 0: no limit (benchmarks of the bare message path)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=HubConfig.max_batch,
        help="draft jobs (sessions) drafted together in one batched forward, taken "
        "fairly across targets; 1 drafts one session at a time",
    )
    p.add_argument(
        "--gather",
        action=argparse.BooleanOptionalAction,
        default=HubConfig.gather,
        help="before drafting a batch, wait (at most one batch's service time) for "
        "the verdicts due by then, so targets share batches instead of "
        "splitting into groups that take turns",
    )
    p.add_argument(
        "--predraft-branches",
        type=int,
        default=HubConfig.predraft_branches,
        help="while no job waits, draft ahead for this many likely verdicts per "
        "session whose proposal is out (draft-kind llm); 0 turns it off",
    )
    p.add_argument(
        "--predraft-max-in-flight",
        type=int,
        default=HubConfig.predraft_max_in_flight,
        help="pre-draft only while at most this many proposals are out (with more, "
        "pre-draft steps delay real jobs more than their hits save)",
    )
    _add_tree_args(p)
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on http://--metrics-host:PORT/metrics (off by default)",
    )
    p.add_argument("--metrics-host", default=HubConfig.metrics_host)
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow plain text on a non-loopback --bind (trusted networks only)",
    )
    args = p.parse_args(argv)
    _resolve_drafter(args)
    if (args.draft_kind == "emulated") != (args.draft_profile is not None):
        p.error("--draft-kind emulated and --draft-profile go together")
    if args.max_batch < 1:
        p.error(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.predraft_branches < 0:
        p.error(f"--predraft-branches must be >= 0, got {args.predraft_branches}")
    if args.predraft_max_in_flight < 1:
        p.error(f"--predraft-max-in-flight must be >= 1, got {args.predraft_max_in_flight}")
    if not 1 <= args.max_gamma <= limits.MAX_GAMMA:
        p.error(f"--max-gamma must be in 1..{limits.MAX_GAMMA}, got {args.max_gamma}")
    if args.gamma != "auto" and not 0 <= args.gamma <= args.max_gamma:
        p.error(f"--gamma must be auto or in 0..{args.max_gamma} (--max-gamma), got {args.gamma}")
    try:
        config = HubConfig(**vars(args))
    except ValueError as exc:
        p.error(str(exc))
    if (config.curve_secret is None) != (config.allow_dir is None):
        p.error("--curve-secret and --allow-dir go together")
    return config


def _add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--quantize``: the numbers the drafter computes in."""
    p.add_argument("--dtype", default=HubConfig.dtype, choices=["float32", "float16", "bfloat16"])
    p.add_argument(
        "--quantize",
        default=HubConfig.quantize,
        choices=QUANTIZE_MODES,
        help="an EAGLE head's projections in int8 weights (PyTorch's dynamic quantization; "
        "its fc stays float32): auto (default) on a CPU in float32, none, or int8",
    )


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    """``--tree`` and the tree's shape."""
    p.add_argument(
        "--tree",
        default=HubConfig.tree,
        choices=TREE_MODES,
        help="token trees, for targets that verify them: auto (default) picks a chain or a "
        "tree size (the shape below, then half its nodes one depth shallower, at most three) "
        "for every session at once by the tokens per second measured in each (chains when the "
        "hub is fully loaded); on: always trees of the shape below; off: chains only",
    )
    p.add_argument(
        "--tree-width",
        type=int,
        default=HubConfig.tree_width,
        help="a tree expands this many nodes per depth, with this many children each",
    )
    p.add_argument("--tree-depth", type=int, default=HubConfig.tree_depth)
    p.add_argument(
        "--tree-nodes",
        type=int,
        default=HubConfig.tree_nodes,
        help="the most nodes of a tree (the best by the draft's path probability); the "
        "largest tree --tree auto tries",
    )


def _resolve_drafter(args: argparse.Namespace) -> None:
    """The drafter (kind, model, and an EAGLE head's target) from --pair and what was given."""
    pair = args.__dict__.pop("pair")
    args.draft_kind, args.model = models.default_drafter(pair, args.draft_kind, args.model)
    if args.draft_kind in ("eagle", "eagle3") and args.target is None:
        args.target = str(models.PAIRS[pair][0])


def _gamma(text: str) -> int | str:
    """``--gamma``: "auto" or an integer (its range is checked against --max-gamma)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor an integer") from None


async def run(config: HubConfig, hub: Hub) -> None:
    """Serve ``hub`` until SIGINT/SIGTERM, then drain."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, hub.stop)
    loop.add_signal_handler(signal.SIGHUP, lambda: hub.allow.reload() if hub.allow else None)
    exporter = None
    if config.metrics_port is not None:
        from starsd.hub import metrics

        exporter = metrics.serve_metrics(hub, config.metrics_host, config.metrics_port)
    ctx = transport.new_context()
    try:
        await hub.serve(ctx)
    finally:
        if exporter is not None:
            exporter.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m starsd.hub``; 0 after a clean drain, 1 if it stopped because
    it could no longer draft, 2 on a setup error."""
    logging.basicConfig(
        level=os.environ.get("STARSD_LOG", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = parse_args(argv)
    try:  # a model that does not load (a bad head, a draft vocabulary out of range): one line
        hub = build_hub(config)
    except (ValueError, OSError) as exc:
        log.error("cannot start the hub: %s", exc)
        return 2
    try:
        transport.run_loop(run(config, hub))
    except (auth.InsecureEndpointError, keys.KeyFileError, router.BindError) as exc:
        log.error("%s", exc)
        return 2
    return 1 if hub.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
