"""Assemble a hub: load the proposer the configuration asks for and the WELCOME it announces."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from starsd import limits, models, protocol
from starsd.hub.config import HubConfig
from starsd.hub.drafters.base import Proposer
from starsd.hub.pacing import Pacer, TreePlan
from starsd.hub.policy import GammaPolicy, PolicyParams
from starsd.hub.server import Hub
from starsd.hub.sessions import Limits
from starsd.protocol import Welcome
from starsd.tree_shapes import TreeShape, tree_ladder

if TYPE_CHECKING:
    from starsd.hub.predraft import Predrafter

log = logging.getLogger("starsd.hub")


def build_hub(config: HubConfig) -> Hub:
    """Load the proposer and assemble a hub (no sockets yet)."""
    import torch

    torch.set_num_threads(config.threads)
    proposer, info = load_proposer(config)
    welcome = Welcome(
        model=Path(config.model).name or config.model,
        vocab_size=info.vocab_size,
        tokenizer=info.tokenizer_fingerprint,
        epoch=secrets.token_bytes(protocol.EPOCH_BYTES),
        default_gamma=config.default_gamma,
        max_gamma=config.max_gamma,
        draft_kind=config.draft_kind,
        heartbeat_ms=int(1000 * config.heartbeat_s),
        feature_width=proposer.feature_width,
        feature_layers=",".join(map(str, proposer.feature_layers)),
        tree_nodes=config.tree_budget if proposer.trees else 0,
    )
    predrafter = predrafter_for(proposer, config)
    if predrafter is not None:  # its branches go to the sessions that ask for them
        welcome = dataclasses.replace(welcome, push=min(predrafter.branches, limits.MAX_PUSH))
    table_limits = limits_of(config, welcome, proposer.max_positions)
    return Hub(config, proposer, welcome, table_limits, pacer_for(config, proposer), predrafter)


def limits_of(config: HubConfig, welcome: Welcome, max_positions: int | None) -> Limits:
    """The session table's limits from the hub's configuration and what it announces."""
    return Limits(
        max_sessions=config.max_sessions,
        max_sessions_per_target=config.max_sessions_per_target,
        default_gamma=config.default_gamma,
        max_gamma=config.max_gamma,
        lease_s=protocol.LIVENESS_INTERVALS * config.heartbeat_s,
        vocab_size=welcome.vocab_size,
        max_positions=max_positions,
        feature_width=welcome.feature_width,
        feature_dtype=welcome.feature_dtype,
        auto_gamma=config.auto_gamma,
    )


def pacer_for(config: HubConfig, proposer: Proposer) -> Pacer:
    """The drafting thread's ``--gamma auto`` (which leaves sessions with a fixed gamma, and
    every session under --gamma N, as they are)."""
    params = PolicyParams(max_gamma=config.max_gamma, start_gamma=max(config.default_gamma, 1))
    trees = None
    if proposer.trees and config.tree_budget:
        largest = TreeShape(config.tree_width, config.tree_depth, config.tree_budget)
        trees = TreePlan(config.tree, tree_ladder(largest))
    return Pacer(GammaPolicy(params), proposer.max_positions, trees=trees)


def predrafter_for(proposer: Proposer, config: HubConfig) -> Predrafter | None:
    """Pre-drafting for a draft LLM hub unless turned off (EAGLE needs the verdict's features)."""
    from starsd.hub.drafters.llm import LlmProposer
    from starsd.hub.predraft import Predrafter

    if not isinstance(proposer, LlmProposer) or config.predraft_branches == 0:
        return None
    return Predrafter(
        proposer,
        config.predraft_branches,
        rows=min(32, config.max_batch),
        max_sessions=config.max_sessions,
        max_in_flight=config.predraft_max_in_flight,
        reach=1 if config.auto_gamma else 0,
    )


def load_proposer(config: HubConfig) -> tuple[Proposer, models.TokenizerInfo]:
    """The proposer of ``config.draft_kind`` and the tokenizer it drafts in."""
    if config.draft_kind in ("eagle", "eagle3"):
        return _eagle_proposer(config)
    if config.draft_kind == "emulated":
        return _emulated_proposer(config)
    from starsd.hub.drafters.vocab import load_draft_vocab

    vocab = load_draft_vocab(config.model)
    draft = models.load_causal_lm(
        config.model, config.device, config.dtype, lean=config.forward == "auto"
    )
    if vocab is not None and draft.vocab_size != vocab.size + 1:
        raise ValueError(
            f"{config.model}: a draft over {vocab.size} tokens has {vocab.size + 1} "
            f"token rows (the last for the rest), this one {draft.vocab_size}"
        )
    size = draft.vocab_size if vocab is None else vocab.target_size  # WELCOME speaks target ids
    info = models.TokenizerInfo(draft.name, size, draft.tokenizer_fingerprint, draft.max_positions)
    if config.draft_kind == "null":
        from starsd.hub.drafters.null import NullProposer

        return NullProposer(), info
    from starsd.hub.drafters.llm import LlmProposer

    if vocab is not None:
        log.info(
            "draft %s predicts over %d of the target's %d tokens",
            draft.name,
            vocab.size,
            vocab.target_size,
        )
    return LlmProposer(draft, vocab), info


def _eagle_proposer(config: HubConfig) -> tuple[Proposer, models.TokenizerInfo]:
    from starsd.hub.drafters import eagle3_head, eagle_head
    from starsd.hub.drafters.eagle import EagleProposer
    from starsd.hub.drafters.quantize import quantize_linears

    target_dir = config.target or str(models.DEFAULT_TARGET_DIR)
    args = (config.model, target_dir, config.dtype, config.device)
    head: eagle_head.LoadedEagle | eagle3_head.LoadedEagle3
    if config.draft_kind == "eagle3":
        head = eagle3_head.load_eagle3_head(*args)
    else:
        head = eagle_head.load_eagle_head(*args)
    if config.int8_head:
        quantize_linears(head.head)
    info = models.load_tokenizer_info(target_dir)
    log.info(
        "%s head %s for target %s: features of width %d from its hidden states %s",
        "EAGLE-3" if config.draft_kind == "eagle3" else "EAGLE",
        config.model,
        info.name,
        head.feature_width,
        list(head.feature_layers) or "[last]",
    )
    return EagleProposer(head, info.max_positions), info


def _emulated_proposer(config: HubConfig) -> tuple[Proposer, models.TokenizerInfo]:
    """No weights: the tokenizer of ``config.model`` and the costs of ``config.draft_profile``."""
    from starsd.hub.drafters.emulated import EmulatedProposer

    assert config.draft_profile is not None  # HubConfig checks it
    proposer = EmulatedProposer.from_profile(config.draft_profile)
    log.info("emulated drafting: S(B, g) of %s", config.draft_profile)
    return proposer, models.load_tokenizer_info(config.model)
