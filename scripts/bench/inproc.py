"""The in-process modes: the target alone, and the centralized speculative loop (the hub's
proposer and the target's verifier called back to back in one process, no wire). They are the
baselines the distributed modes are judged against, and what the analytic model's costs come
from (``python -m scripts.bench.run``, ``scripts/bench/real.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from edge.backends.torch import TorchBackend
from edge.verifier import TargetSequence
from scripts.bench.common import BenchConfig, run_record
from scripts.bench.harness import PROMPTS as HARNESS_PROMPTS
from starsd import models, tree
from starsd.hub.drafters.base import DraftJob, Proposer
from starsd.protocol import Proposal, SamplingParams
from starsd.stats import latency_summary
from starsd.tree_shapes import TreeShape

PROMPTS = HARNESS_PROMPTS[:6]


def bench_standalone(
    target: models.LoadedModel, cfg: BenchConfig, prompts: Sequence[list[int]] | None = None
) -> tuple[dict, float, list[list[int]]]:
    """The target alone; returns its record, the mean decode step (T_ar) and the generated ids
    per prompt (what every greedy mode must reproduce)."""
    tokens, seconds, lat, ids = 0, 0.0, [], []
    backend = TorchBackend(target)
    for prompt in prompts or _encoded(target):
        seq = TargetSequence(backend, list(prompt), SamplingParams(), cfg.max_new_tokens)
        started = time.perf_counter()
        while not seq.done:
            seq.step()
        seconds += time.perf_counter() - started
        tokens += len(seq.generated)
        lat += seq.stats.token_latency_s
        ids.append(list(seq.generated))
    rate = tokens / seconds
    return (
        run_record(
            "standalone",
            1,
            system_tokens_per_s=rate,
            per_target_tokens_per_s=rate,
            latency_ms=latency_summary(lat),
        ),
        seconds / tokens,
        ids,
    )


def bench_centralized(
    target: models.LoadedModel,
    drafter: Proposer,
    cfg: BenchConfig,
    prompts: Sequence[list[int]] | None = None,
    tree_shape: TreeShape | None = None,
) -> tuple[dict, dict[str, float]]:
    """Draft and target in one process; also measures S(d) and the verify time per round.

    The same loop serves both backends: with EAGLE the target keeps its features and each
    job carries those the drafter has not seen, exactly as OPEN and DRAFT do over the wire.
    With ``tree_shape`` every round drafts a token tree of that shape (its verdict names the
    accepted path, as DRAFT does).
    """
    eagle = drafter.feature_width > 0
    taps = (drafter.feature_layers or (-1,)) if eagle else ()
    tokens = rounds = accepted = 0
    draft_s = verify_s = 0.0
    lat: list[float] = []
    backend = TorchBackend(target)
    started = time.perf_counter()
    for prompt in prompts or _encoded(target):
        ids = list(prompt)
        seq = TargetSequence(backend, ids, SamplingParams(), cfg.max_new_tokens, taps)
        state = drafter.new_state(ids, SamplingParams(), cfg.gamma)
        job = DraftJob(b"", 0, state, 0, (), features=_features(seq, 0, eagle))
        while not seq.done:
            state.tree = tree_shape
            t0 = time.perf_counter()
            (proposal,) = drafter.propose([job])
            t1 = time.perf_counter()
            assert isinstance(proposal, Proposal), proposal
            synced, drafts = seq.committed, [int(t) for t in proposal.tokens]
            parents = None if proposal.parents is None else proposal.parents.tolist()
            n, appended = seq.verify(drafts, None, parents)
            verify_s += time.perf_counter() - t1
            kept = seq.generated[synced - len(ids) :][:n]
            path = None if parents is None else tuple(tree.accepted_path(drafts, parents, kept))
            draft_s += t1 - t0
            rounds, accepted = rounds + 1, accepted + n
            job = DraftJob(
                b"",
                job.seq + 1,
                state,
                n,
                tuple(appended),
                features=_features(seq, synced - 1, eagle),
                path=path,
            )
        tokens += len(seq.generated)
        lat += seq.stats.token_latency_s
    rate = tokens / (time.perf_counter() - started)
    record = run_record(
        "centralized",
        1,
        system_tokens_per_s=rate,
        per_target_tokens_per_s=rate,
        acceptance_rate=accepted / (rounds * cfg.gamma),
        mean_accepted=accepted / rounds,
        latency_ms=latency_summary(lat),
        draft_kind=drafter.kind,
    )
    return record, {
        "draft_s": draft_s / rounds,
        "verify_s": verify_s / rounds,
        "mean_accepted": accepted / rounds,
    }


def _encoded(target: models.LoadedModel) -> list[list[int]]:
    """The toy pair's prompts as the target's token ids."""
    return [models.encode_text(target, prompt) for prompt in PROMPTS]


def _features(seq: TargetSequence, start: int, eagle: bool) -> Any:
    """The features a job carries (EAGLE only): positions ``start`` .. all but the last."""
    return seq.features(start, seq.committed - 1) if eagle else None


def eagle_drafter(cfg: BenchConfig) -> Proposer:
    """The hub's EAGLE drafter for the benchmark's target, built as the hub builds it."""
    from starsd.hub.drafters import eagle_head as eagle
    from starsd.hub.drafters.eagle import EagleProposer

    head = eagle.load_eagle_head(cfg.eagle, cfg.target)
    return EagleProposer(head, models.load_tokenizer_info(cfg.target).max_positions)
