"""The real pair's costs at B sequences, and what the analytic model predicts from them.

Measured in the benchmark's own process, one torch thread, the sizes alternating across repeats
(this machine's speed drifts):

* ``step``: T(B), one target forward of B rows of one token each after a 128-token cache (the
  standalone decode step of B sequences batched);
* ``verify``: V(B, g), the same forward with g + 1 tokens per row (a verification);
* ``draft``: S(B, g), the hub's proposer drafting g tokens for B sessions in one call, timed
  cold: before each timed call the target's weights are read once, as the target's forward
  reads them between two of the hub's batches when both run on this machine (the caches are
  shared). Hot, with the head's weights left in the caches by the call before, the EAGLE-3
  head drafted 8 sessions in 7.8 ms against 10.1 ms cold and 10-11 ms in a running hub.

Predictions, each a speedup over the target alone at the same concurrency:

* one target with N sequences (``--concurrency N``): its N sequences verified as one batch and
  drafted as one batch, in series: E[L] T(N) / (S(N, g) + V(N, g)); ``--gamma auto`` the best
  of that over the measured gammas and decoding alone (1.0);
* the same target serving a stream (``--concurrency N`` over more requests than N, each
  request's slot taken by the next as it ends): its decoding simulated forward by forward at the
  rows still open (a stream's first and last forwards carry fewer than N, and this CPU's costs
  are no line in the rows: a verification of 3 positions costs 2.0x a step at 3 rows, 1.09x at
  8), the costs between the measured sizes interpolated, each forward committing E[L] tokens a
  row (1 alone); what the target alone spent beyond its simulated decoding (the prompts'
  prefills) is added to both sides (``one_target_stream``);
* N targets of one sequence each on one hub: ``starsd.analytic.predict`` with S(B, g) from the
  measured draft costs (the hub batches the jobs that wait together), each target on hardware
  of its own: per target, the tokens per round over T_gamma against E[L] = 1 per T(1).

E[L] comes from alpha, inverted from the centralized loop's mean accepted drafts at each gamma.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from edge.backends.torch import TorchBackend
from scripts.bench.service import FakeSessions
from starsd import analytic, models
from starsd.batch import SequenceCache
from starsd.hub.drafters.base import Proposer
from starsd.service import ServiceCurve

CACHED = 128  # context tokens before every timed forward (about a chat prompt's length)


def time_target(
    target: models.LoadedModel, sizes: Sequence[int], widths: Sequence[int], repeats: int
) -> dict[int, dict[int, float]]:
    """Median seconds of one target forward: {B: {tokens per row: s}}."""
    backend = TorchBackend(target)
    (prefix,) = backend.forward([SequenceCache()], [list(range(1, CACHED + 1))])
    times: dict[tuple[int, int], list[float]] = {(b, w): [] for b in sizes for w in widths}
    cells = list(times)
    for rep in range(repeats + 1):  # the first pass warms up
        for b, w in cells if rep % 2 == 0 else reversed(cells):
            began = time.perf_counter()
            backend.forward([prefix.cache] * b, [list(range(100, 100 + w))] * b)
            if rep:
                times[(b, w)].append(time.perf_counter() - began)
    out: dict[int, dict[int, float]] = {b: {} for b in sizes}
    for (b, w), ts in times.items():
        out[b][w] = statistics.median(ts)
    return out


def time_drafts(
    proposer: Proposer,
    vocab: int,
    sizes: Sequence[int],
    gammas: Sequence[int],
    repeats: int,
    between: Callable[[], object] | None = None,
) -> dict[int, dict[int, float]]:
    """Median seconds of one ``propose`` call: {B: {gamma: s}}; ``between`` runs before each
    call, untimed (what else the machine does between two batches)."""
    out: dict[int, dict[int, float]] = {b: {} for b in sizes}
    for g in gammas:
        sessions = FakeSessions(proposer, vocab, g)
        pools = {b: sessions.open(b, CACHED) for b in sizes}
        times: dict[int, list[float]] = {b: [] for b in sizes}
        for rep in range(repeats + 1):
            for b in sizes if rep % 2 == 0 else tuple(reversed(sizes)):
                if between is not None:
                    between()
                elapsed = sessions.propose(pools[b])
                if rep:
                    times[b].append(elapsed)
        for b, ts in times.items():
            out[b][g] = statistics.median(ts)
    return out


def measure(
    target: models.LoadedModel,
    proposer: Proposer,
    sizes: Sequence[int],
    gammas: Sequence[int],
    repeats: int,
) -> dict[str, Any]:
    """T(B), V(B, g) and S(B, g) in milliseconds, keyed by str(B) then str(g) (JSON)."""
    print(f"[costs] T, V and S at B = {list(sizes)}, gamma = {list(gammas)} ...", flush=True)
    forward = time_target(target, sizes, [1, *(g + 1 for g in gammas)], repeats)
    ms = 1e3
    return {
        "step_ms": {str(b): ms * forward[b][1] for b in sizes},
        "verify_ms": {str(b): {str(g): ms * forward[b][g + 1] for g in gammas} for b in sizes},
        "draft_ms": draft_ms(proposer, target, sizes, gammas, repeats),
    }


def draft_ms(
    proposer: Proposer,
    target: models.LoadedModel,
    sizes: Sequence[int],
    gammas: Sequence[int],
    repeats: int,
) -> dict[str, dict[str, float]]:
    """S(B, g) of ``proposer`` in milliseconds, keyed by str(B) then str(g) (JSON), timed
    cold (``target``'s weights read before each call; see the module docstring)."""
    weights = [p.detach() for p in target.model.parameters()]

    def read_weights() -> None:
        for w in weights:
            w.sum()

    drafts = time_drafts(proposer, target.vocab_size, sizes, gammas, repeats, read_weights)
    return {str(b): {str(g): 1e3 * drafts[b][g] for g in gammas} for b in sizes}


def expected_tokens(mean_accepted: float, gamma: int) -> float:
    """E[L] at ``gamma`` from a measured mean of accepted drafts (alpha inverted)."""
    alpha = analytic.alpha_from_mean_accepted(mean_accepted, gamma)
    return analytic.expected_tokens_per_round(alpha, gamma)


def one_target_batched(costs: dict[str, Any], accepted: dict[int, float], n: int) -> dict:
    """Speedup of one target at ``--concurrency n`` per gamma, and auto's (>= 1: alone)."""
    b = str(n)
    step = costs["step_ms"][b]
    per_gamma = {
        g: expected_tokens(a, g)
        * step
        / (costs["draft_ms"][b][str(g)] + costs["verify_ms"][b][str(g)])
        for g, a in accepted.items()
    }
    return {f"g{g}": r for g, r in per_gamma.items()} | {"auto": max(1.0, *per_gamma.values())}


def at_rows(table: dict[str, float], rows: int) -> float:
    """A cost measured at some row counts (``table``: str(B) -> ms), read at ``rows``: linear
    between the two measured sizes around it, the nearest measured one outside them."""
    points = sorted((int(b), ms) for b, ms in table.items())
    if rows <= points[0][0]:
        return points[0][1]
    for (b0, ms0), (b1, ms1) in itertools.pairwise(points):
        if rows <= b1:
            return ms0 + (ms1 - ms0) * (rows - b0) / (b1 - b0)
    return points[-1][1]


def stream_ms(
    lengths: Sequence[int], slots: int, forward_ms: Callable[[int], float], per_row: float
) -> float:
    """Milliseconds of decoding requests of ``lengths`` tokens in order, at most ``slots`` at
    once (an ended request's slot taken by the next): each forward of ``rows`` open requests
    costs ``forward_ms(rows)`` and commits ``per_row`` tokens to each (fluid: the last forward
    of a request is a whole one)."""
    waiting, left, spent = list(lengths), [], 0.0
    while waiting or left:
        while waiting and len(left) < slots:
            left.append(float(waiting.pop(0)))
        spent += forward_ms(len(left))
        left = [n - per_row for n in left if n - per_row > 1e-6]  # (E[L] is inexact)
    return spent


def one_target_stream(
    costs: dict[str, Any],
    accepted: dict[int, float],
    n: int,
    lengths: Sequence[int],
    alone_s: float,
) -> dict:
    """Speedup of one target at ``--concurrency n`` over the stream of requests of ``lengths``
    tokens per gamma, and auto's: both sides decoded forward by forward at the rows still open
    (module docstring), plus what the target alone (``alone_s`` in all) spent beyond its
    simulated decoding: its prefills, the same through a hub."""
    alone_ms = stream_ms(lengths, n, lambda rows: at_rows(costs["step_ms"], rows), 1.0)
    outside_ms = max(1e3 * alone_s - alone_ms, 0.0)
    out = {}
    for g, a in accepted.items():
        draft = {b: ms[str(g)] for b, ms in costs["draft_ms"].items()}
        verify = {b: ms[str(g)] for b, ms in costs["verify_ms"].items()}

        def round_ms(rows: int, draft: dict = draft, verify: dict = verify) -> float:
            return at_rows(draft, rows) + at_rows(verify, rows)

        spent = stream_ms(lengths, n, round_ms, expected_tokens(a, g))
        out[f"g{g}"] = (alone_ms + outside_ms) / (spent + outside_ms)
    return out | {"auto": max(1.0, *out.values())}


def many_targets(costs: dict[str, Any], accepted: dict[int, float], n: int) -> dict:
    """Per-target speedup of ``n`` one-sequence targets on one hub, per gamma and auto's."""
    sizes = sorted(int(b) for b in costs["draft_ms"])
    step = costs["step_ms"]["1"] / 1e3
    out = {}
    for g, a in accepted.items():
        points = [(s, costs["draft_ms"][str(s)][str(g)] / 1e3) for s in sizes]
        inputs = analytic.ModelInputs(
            alpha=analytic.alpha_from_mean_accepted(a, g),
            gamma=g,
            draft_s=points[0][1],
            verify_s=costs["verify_ms"]["1"][str(g)] / 1e3,
            link_s=0.0,
            target_step_s=step,
            max_batch=n,
            curve=ServiceCurve.proportional(points, g),
        )
        out[f"g{g}"] = analytic.predict(inputs, n).per_target_tokens_per_s * step
    return out | {"auto": max(1.0, *out.values())}
