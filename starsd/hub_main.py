"""``python -m starsd.hub``: command line -> HubConfig, drafter loading, run until a signal.

Kept apart from :mod:`starsd.hub` (the protocol dispatcher and drafting thread), which this
module builds and runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
from pathlib import Path

from starsd import auth, keys, models, protocol, transport
from starsd.drafter import DRAFTERS, Drafter
from starsd.hub import Hub, HubConfig
from starsd.protocol import Welcome

log = logging.getLogger("starsd.hub")


def parse_args(argv: list[str] | None = None) -> HubConfig:
    """argparse -> HubConfig."""
    p = argparse.ArgumentParser(prog="python -m starsd.hub",
                                description="StarSD draft hub: one ROUTER, many targets")
    p.add_argument("--model", default=str(models.DEFAULT_DRAFT_DIR),
                   help="draft model dir or hub id")  # fmt: skip
    p.add_argument("--bind", default=HubConfig.bind)
    p.add_argument("--gamma", type=int, default=HubConfig.gamma, help="default draft length")
    p.add_argument("--max-gamma", type=int, default=HubConfig.max_gamma)
    p.add_argument("--device", default=HubConfig.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=HubConfig.dtype, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--max-sessions", type=int, default=HubConfig.max_sessions)
    p.add_argument("--max-sessions-per-target", type=int,
                   default=HubConfig.max_sessions_per_target)  # fmt: skip
    p.add_argument("--max-batch", type=int, default=HubConfig.max_batch,
                   help="cap on the jobs a batching drafter takes at once (chain drafters take 1)")
    p.add_argument("--threads", type=int, default=HubConfig.threads, help="torch threads")
    p.add_argument("--stats-interval", type=float, default=HubConfig.stats_interval)
    p.add_argument("--draft-kind", default=HubConfig.draft_kind,
                   choices=sorted([*DRAFTERS, "eagle"]),
                   help="llm: a draft causal LM (--model); eagle: an EAGLE head (--model) on "
                        "the target's embedding and LM head (--target); null: no model work")
    p.add_argument("--target", help="eagle: the target model directory (default: the "
                                    "project's default target)")  # fmt: skip
    p.add_argument("--heartbeat-s", type=float, default=HubConfig.heartbeat_s,
                   help="liveness interval; a target silent for 3 intervals is freed")
    p.add_argument("--drain-timeout-s", type=float, default=HubConfig.drain_timeout_s)
    p.add_argument("--curve-secret", help="the hub's key pair (starsd keys generate)")
    p.add_argument("--allow-dir", help="directory of allowed targets' public .key files")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain text on a non-loopback --bind (trusted networks only)")
    config = HubConfig(**vars(p.parse_args(argv)))
    if (config.curve_secret is None) != (config.allow_dir is None):
        p.error("--curve-secret and --allow-dir go together")
    return config


def build_hub(config: HubConfig) -> Hub:
    """Load the drafter and assemble a hub (no sockets yet)."""
    import torch

    torch.set_num_threads(config.threads)
    if config.draft_kind == "eagle":
        drafter, info = _eagle_drafter(config)
    else:
        draft = models.load_causal_lm(config.model, config.device, config.dtype)
        drafter = DRAFTERS[config.draft_kind](draft)
        info = models.TokenizerInfo(draft.name, draft.vocab_size, draft.tokenizer_fingerprint,
                                    draft.max_positions)  # fmt: skip
    welcome = Welcome(
        model=Path(config.model).name or config.model,
        vocab_size=info.vocab_size,
        tokenizer=info.tokenizer_fingerprint,
        epoch=secrets.token_bytes(protocol.EPOCH_BYTES),
        default_gamma=config.gamma,
        max_gamma=config.max_gamma,
        draft_kind=config.draft_kind,
        heartbeat_ms=int(1000 * config.heartbeat_s),
        feature_width=drafter.feature_width,
    )
    return Hub(config, drafter, welcome)


def _eagle_drafter(config: HubConfig) -> tuple[Drafter, models.TokenizerInfo]:
    from starsd import eagle
    from starsd.eagle_drafter import EagleDrafter

    target_dir = config.target or str(models.DEFAULT_TARGET_DIR)
    head = eagle.load_eagle_head(config.model, target_dir, config.dtype, config.device)
    info = models.load_tokenizer_info(target_dir)
    log.info("EAGLE head %s on target %s's embedding and LM head (width %d)", config.model,
             info.name, head.config.hidden_size)  # fmt: skip
    return EagleDrafter(head, info.max_positions), info


async def run(config: HubConfig) -> None:
    """Serve until SIGINT/SIGTERM, then drain."""
    hub = build_hub(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, hub.stop)
    loop.add_signal_handler(signal.SIGHUP, lambda: hub.allow.reload() if hub.allow else None)
    ctx = transport.new_context()
    try:
        await hub.serve(ctx)
    finally:
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m starsd.hub``; 0 after a clean drain, 2 on a setup error."""
    logging.basicConfig(
        level=os.environ.get("STARSD_LOG", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = parse_args(argv)
    try:
        transport.run_loop(run(config))
    except (auth.InsecureEndpointError, keys.KeyFileError) as exc:
        log.error("%s", exc)
        return 2
    return 0


