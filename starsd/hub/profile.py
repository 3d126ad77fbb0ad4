"""``starsd profile draft``: S(B, g), the hub's own proposer timed on B sessions at once.

The proposer is loaded exactly as ``python -m starsd.hub`` loads it
(:func:`starsd.hub.build.load_proposer`); each cell (B, g) has its own B synthetic sessions
(:mod:`starsd.hub.synthetic`) that start from a ``context``-token prompt, are prefilled and get
one untimed round, so every timed ``propose`` call of a cell sees contexts of the same length
whatever the order. Each repeat times every cell once, the order reversed on every other repeat
(this machine's speed drifts); a first untimed pass warms up. On CUDA the clock stops after a
synchronize.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from starsd import profile
from starsd.hub.build import load_proposer
from starsd.hub.config import HubConfig
from starsd.hub.synthetic import FakeSessions, Session


def measure_draft(
    config: HubConfig,
    batches: Sequence[int],
    gammas: Sequence[int],
    repeats: int,
    context: int = 128,
    progress: profile.Progress = profile.stderr_progress,
) -> dict[str, Any]:
    """A draft profile's JSON object for ``config``'s drafter (its model, kind, device, dtype)."""
    began = time.perf_counter()
    proposer, info = load_proposer(config)
    cells = [(b, g) for g in gammas for b in batches]
    pools = _pools(proposer, info.vocab_size, cells, context)
    times = _time_cells(pools, cells, repeats, _synchronizer(config.device), progress)
    grid = {
        "service_ms": [{"batch": b, "gamma": g, **profile.summary(times[b, g])} for b, g in cells]
    }
    name = Path(config.model).name or config.model  # an EAGLE head's info names its target
    model = {"name": name, "path": config.model, "draft_kind": config.draft_kind}
    if config.target:
        model["target"] = config.target
    extra = profile.settings(repeats, context, began)
    return profile.measured_profile("draft", model, config.device, config.dtype, grid, **extra)


def _synchronizer(device: str) -> Callable[[], None]:
    """What to call before reading the clock: CUDA's synchronize, else nothing."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def _pools(
    proposer: Any, vocab: int, cells: Sequence[tuple[int, int]], context: int
) -> dict[tuple[int, int], tuple[FakeSessions, list[Session]]]:
    """Per cell: its sessions, prefilled and past one untimed round."""
    pools = {}
    for b, g in cells:
        driver = FakeSessions(proposer, vocab, g, seed=b * 1000 + g)
        sessions = driver.open(b, context)
        driver.propose(sessions)  # the first DRAFT after the prefill
        pools[(b, g)] = (driver, sessions)
    return pools


def _time_cells(
    pools: dict[tuple[int, int], tuple[FakeSessions, list[Session]]],
    cells: Sequence[tuple[int, int]],
    repeats: int,
    sync: Callable[[], None],
    progress: profile.Progress,
) -> dict[tuple[int, int], list[float]]:
    """Seconds per ``propose`` call of every cell, ``repeats`` times, after one warm-up pass."""
    times: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    for rep in range(repeats + 1):
        for cell in profile.alternated(cells, rep):
            driver, sessions = pools[cell]
            sync()
            elapsed = driver.propose(sessions)
            sync()
            if rep:
                times[cell].append(elapsed)
        progress(f"[draft] {'warm-up' if rep == 0 else f'repeat {rep}/{repeats}'} done")
    return times
