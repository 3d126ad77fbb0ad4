"""The analytic model of one draft hub serving N targets, with batched drafting.

The command line (tables, plots): :mod:`starsd.analytic.cli`, ``python -m starsd.analytic``.

Terms (times per round of one target):
  E[L]   expected tokens a round commits: (1 - alpha^(gamma+1)) / (1 - alpha) for i.i.d.
         acceptance with rate alpha (gamma + 1 when alpha = 1);
  S(B)   the hub's service time for one batch of B proposals of gamma tokens each (one batched
         forward, delivery included); S(1) is the one-at-a-time S(d);
  M      the hub's largest batch (--max-batch);
  R      what happens outside the hub: the target's verify forward plus the link round trip;
  T_ar   the target's own autoregressive step (the standalone baseline: 1 / T_ar tokens/s).

N targets, one sequence each. Every round the hub must draft one job per target; with batches of
at most M those N jobs form k = ceil(N / M) batches, as equal as possible (largest first:
B_1 = ceil(N / k)). The hub's iteration takes T_gamma = T_busy + T_idle, where
T_busy = sum_j S(B_j) and T_idle = max(0, S(B_1) + R + (B_1 - 1) c - T_busy): a target's own
cycle is at least its batch's service plus R, plus the time its batch takes to assemble (the hub
handles messages one after another, c each, and gathers a batch's jobs before drafting it), and
the hub waits for verdicts when the other batches are done sooner. Where the drafter computes on
the processor the message path runs on (``messages_share_drafter``: a CPU drafter beside the
hub's event loop), the two take turns and a batch of B is served in S(B) + B c.

  system tok/s = N * E[L] / T_gamma, per-target tok/s = E[L] / T_gamma, hub busy = T_busy / T_gamma.

Under-loaded (T_idle > 0): every target gets a round every S(B_1) + R. Up to N = M that is one
batch, T_gamma = S(N) + R, and system throughput grows almost linearly with N while S(N) stays
near S(1). Fully loaded (T_idle = 0, from N_full on, the smallest N with T_idle = 0): the hub
drafts all the time; with full batches system throughput is M * E[L] / S(M), i.e.
M * S(1) / S(M) times the one-at-a-time ceiling E[L] / S(1), and more targets only queue. With a
flat curve S(B) = s the boundary is N_full = M * ceil(R / s) + 1: batching moves N_full out by
about a factor M. Per-target throughput falls below the standalone 1 / T_ar once
T_gamma > E[L] * T_ar (break-even N).

M = 1 is the one-at-a-time hub: k = N, T_busy = N * S(1), T_idle = max(0, S(1) + R - N * S(1)),
N_full = ceil((S(1) + R) / S(1)) and the fully loaded ceiling is E[L] / S(1).

Auto gamma (``--gamma auto``, the hub's default): the hub picks each round's gamma in 0..G by
:func:`starsd.goodput.best_gamma`, the rule :mod:`starsd.hub.policy` applies per session. Here every
target is alike, so :func:`auto_gamma` runs the rule against the model itself: at the current gamma
g it predicts the regime, the queue wait W and the largest batch B_1, asks the rule for the best g'
given S(B_1, g') (:mod:`starsd.service`: measured at the inputs' gamma, one feed and g' - 1 decode
steps, each costing as much as the feed), R(g') (the verify moved along ``verify_per_token_s``,
the hub's own fitted slope; 0, R constant, by default) and T_alone = T_ar, and repeats until g'
= g (where the hub settles), or, should the rule cycle (0, then speculation once the hub idles),
takes the cycle's best. gamma 0 is the target alone: N / T_ar, the hub idle.

Token trees (``ModelInputs.tree``, a :class:`TreeRound`): every round drafts a tree instead of a
chain, so S(B) is the curve's tree cost (:meth:`starsd.service.ServiceCurve.tree_at`) and E[L]
the tree's own (:func:`expected_tree_tokens`, or measured); R then holds the verification of the
tree's nodes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starsd.goodput import best_gamma
from starsd.service import ServiceCurve

MAX_TARGETS = 100_000  # how far saturation_point and break_even_targets search in N


@dataclass(frozen=True)
class TreeRound:
    """Rounds that draft a token tree: grown ``depth`` deep, ``width`` nodes expanded per depth,
    committing ``tokens_per_round`` on average (accepted path + the target's token)."""

    width: int
    depth: int
    tokens_per_round: float


@dataclass(frozen=True)
class ModelInputs:
    """Measured (or assumed) inputs of the model; times in seconds.

    ``curve`` None is the one-at-a-time hub: S(1) = ``draft_s`` and no batching, so
    ``max_batch`` must then be 1 (assuming S(B) = S(1) for every B would make batching free).
    With a curve, S(B) = ``curve.at(B, gamma)`` for every B, S(1) included; ``draft_s`` stays
    the one-at-a-time figure it was measured as.
    """

    alpha: float  # per-token acceptance rate
    gamma: int
    draft_s: float  # S(d) = S(1): hub time to draft one proposal alone
    verify_s: float  # target verify forward of gamma + 1 positions
    link_s: float  # network round trip + (de)serialisation per round
    target_step_s: float  # T_ar: the target's standalone decode step
    max_batch: int = 1  # M: the most jobs the hub drafts in one batch
    curve: ServiceCurve | None = None  # S(B, g); None: one-at-a-time
    hit_rate: float = 0.0  # h: share of jobs answered from a pre-drafted branch when idle
    # tau (<= h): of which its target had taken the branch pushed to it (Open.push): that round
    # costs the target's verify alone, no link and no hub time on its path
    taken_rate: float = 0.0
    # c: the hub's serial per-message handling (receive, decode, enqueue; deliver, send); the
    # jobs of one batch arrive one after another, so the batch of B starts (B - 1) c after its
    # first (gathering waits for them)
    per_message_s: float = 0.0
    # the drafter computes on the processor the hub's message path runs on (a CPU drafter):
    # the two take turns, so each job's messages lengthen its batch's service by c
    messages_share_drafter: bool = False
    tree: TreeRound | None = None  # every round drafts this tree (None: chains of gamma)
    # dV/dg: how much the verify grows per draft token (0: R constant in gamma); a GPU's
    # verify of 2 or 9 positions costs about one step, a CPU's grows with every position
    verify_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1], got {self.hit_rate}")
        if not 0.0 <= self.taken_rate <= self.hit_rate:
            raise ValueError(f"taken_rate must be in [0, hit_rate], got {self.taken_rate}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_batch > 1 and self.curve is None:
            raise ValueError("max_batch > 1 needs a service curve S(B)")
        if self.tree is not None and self.curve is None:
            raise ValueError("tree rounds need a service curve S(B, g) to cost their forwards")


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for N targets."""

    n_targets: int
    regime: str  # "under-loaded" | "fully-loaded"
    iteration_s: float  # T_gamma
    idle_s: float  # T_idle
    system_tokens_per_s: float
    per_target_tokens_per_s: float
    hub_busy_fraction: float
    batches: int = 1  # k
    largest_batch: int = 1  # B_1


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[L]: tokens committed per round (accepted drafts + the target's own token)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tree_tokens(alpha: float, sibling_alpha: float, parents: Sequence[int]) -> float:
    """E[L] through the token tree of ``parents`` (``starsd.tree``; a node's children in the
    draft's order of preference) when the target's next token is a node's first child with
    probability ``alpha`` and, failing that, each next child in turn with ``sibling_alpha``:
    1 + the sum over nodes of the chance their path is accepted. A chain gives
    :func:`expected_tokens_per_round`."""
    reach = [1.0] + [0.0] * len(parents)  # row 0: the root; row i + 1: node i
    missed = [1.0] * (len(parents) + 1)  # per row: the chance its children so far all missed
    elders = [0] * (len(parents) + 1)  # per row: its children so far
    for node, parent in enumerate(parents):  # (a parent comes before its children)
        row = parent + 1
        hit = alpha if elders[row] == 0 else sibling_alpha
        reach[node + 1] = reach[row] * missed[row] * hit
        missed[row] *= 1 - hit
        elders[row] += 1
    return sum(reach)


# A draft's runner-up acceptance, the default of the trees' acceptance model: the chance its
# next choice at a node holds the target's token when the ones before missed. Fitted to the real
# pair (SmolLM2-135M + its EAGLE-3 head, greedy, per-position acceptance 0.32): trees of 6 / 8 /
# 12 nodes committed 1.63 / 1.65 / 1.76 tokens a round, this gives 1.62 / 1.64 / 1.67
SIBLING_ALPHA = 0.15


def pick_shape(chain: Prediction, trees: Sequence[Prediction]) -> int:
    """``--tree auto``'s choice as the model sees it: 0 (the chain) unless the chain's rounds
    leave the hub under-loaded (a full hub drafts chains; targets decoding alone draft
    nothing), else the option (0 the chain, k the k-th tree) whose rounds make a target the
    most tokens per second, among those that leave the hub under-loaded."""
    best, rate = 0, chain.per_target_tokens_per_s
    if chain.regime != "under-loaded":
        return 0
    for k, tree in enumerate(trees, start=1):
        if tree.regime == "under-loaded" and tree.per_target_tokens_per_s > rate:
            best, rate = k, tree.per_target_tokens_per_s
    return best


def tokens_per_round(inputs: ModelInputs) -> float:
    """E[L] of the inputs' rounds: their tree's, or a chain's of gamma tokens."""
    if inputs.tree is not None:
        return inputs.tree.tokens_per_round
    return expected_tokens_per_round(inputs.alpha, inputs.gamma)


def alpha_from_mean_accepted(mean_accepted: float, gamma: int) -> float:
    """Invert E[accepted] = E[L] - 1 for alpha (bisection; E[L] grows with alpha)."""
    target = min(max(mean_accepted + 1.0, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_round(mid, gamma) < target else (lo, mid)
    return (lo + hi) / 2


def round_trip_outside_hub(inputs: ModelInputs) -> float:
    """R: the part of a round the hub does not spend on this target."""
    return inputs.verify_s + inputs.link_s


def service_s(inputs: ModelInputs, batch: int) -> float:
    """S(batch): the curve's value (a tree round's with a tree), or ``draft_s`` for the
    one-at-a-time hub; plus ``batch`` x c where the messages share the drafter's processor."""
    shared = batch * inputs.per_message_s if inputs.messages_share_drafter else 0.0
    return _drafting_s(inputs, batch) + shared


def _drafting_s(inputs: ModelInputs, batch: int) -> float:
    """The drafter's own time for a batch, as profiled."""
    if inputs.curve is None:
        return inputs.draft_s
    if inputs.tree is not None:
        return inputs.curve.tree_at(batch, inputs.tree.width, inputs.tree.depth)
    return inputs.curve.at(batch, inputs.gamma)


def batch_sizes(n_targets: int, max_batch: int) -> tuple[int, ...]:
    """The sizes of the k = ceil(N / M) batches of one iteration, as equal as possible,
    largest first."""
    k = -(-n_targets // max_batch)
    q, r = divmod(n_targets, k)
    return (q + 1,) * r + (q,) * (k - r)


def _busy(inputs: ModelInputs, n_targets: int) -> tuple[float, int, int]:
    """(T_busy, k, B_1) for ``n_targets``: at most two distinct sizes, so two S lookups."""
    k = -(-n_targets // inputs.max_batch)
    q, r = divmod(n_targets, k)
    busy = (k - r) * service_s(inputs, q)  # M = 1: N * S(1), as the one-at-a-time formula
    if r:
        busy += r * service_s(inputs, q + 1)
    return busy, k, q + 1 if r else q


def _idle(inputs: ModelInputs, n_targets: int) -> tuple[float, float, int, int]:
    """(T_idle, T_busy, k, B_1) for ``n_targets``; T_busy counts drafting on the critical path.

    Pre-drafting (hit rate h) works only in idle time: when the hub idles without it, a share
    h of the jobs is answered from branches drafted meanwhile, so a round takes
    (1 - h) S(B_1) + R and the hub's critical-path work shrinks by (1 - h); of those, a share
    tau had been pushed to the target and taken there, which also takes the link off the round:
    (1 - h) S(B_1) + R - tau * link. Fully loaded, there is no idle time to pre-draft in, and
    h and tau change nothing.
    """
    if n_targets < 1:
        raise ValueError(f"n_targets must be >= 1, got {n_targets}")
    busy, k, first = _busy(inputs, n_targets)
    arrivals = (first - 1) * inputs.per_message_s  # the batch's last job arrives this late
    cycle = service_s(inputs, first) + round_trip_outside_hub(inputs) + arrivals
    if busy >= cycle or inputs.hit_rate == 0.0:
        return max(0.0, cycle - busy), busy, k, first
    miss, link_saved = 1.0 - inputs.hit_rate, inputs.taken_rate * inputs.link_s
    cycle = miss * service_s(inputs, first) + round_trip_outside_hub(inputs) - link_saved + arrivals
    return max(0.0, cycle - miss * busy), miss * busy, k, first


def predict(inputs: ModelInputs, n_targets: int) -> Prediction:
    """Throughput and regime for ``n_targets`` targets."""
    idle, busy, k, first = _idle(inputs, n_targets)
    iteration = busy + idle  # T_gamma
    tokens = tokens_per_round(inputs)
    return Prediction(
        n_targets=n_targets,
        regime="under-loaded" if idle > 0 else "fully-loaded",
        iteration_s=iteration,
        idle_s=idle,
        system_tokens_per_s=n_targets * tokens / iteration,
        per_target_tokens_per_s=tokens / iteration,
        hub_busy_fraction=busy / iteration,
        batches=k,
        largest_batch=first,
    )


def saturation_point(inputs: ModelInputs) -> int:
    """N_full: the fewest targets that keep the hub drafting all the time (T_idle = 0).

    A scan, not a formula: a measured S(B) need not be smooth. Raises ValueError when the hub
    still idles at MAX_TARGETS.
    """
    for n in range(1, MAX_TARGETS + 1):
        if _idle(inputs, n)[0] == 0.0:
            return n
    raise ValueError(f"the hub still idles at N = {MAX_TARGETS} targets")


def break_even_targets(inputs: ModelInputs) -> int:
    """Largest N up to which each target is at least as fast as standalone (0: not even one;
    capped at MAX_TARGETS): every N' <= N has T_gamma <= E[L] * T_ar."""
    budget = tokens_per_round(inputs) * inputs.target_step_s
    for n in range(1, MAX_TARGETS + 1):
        idle, busy, _, _ = _idle(inputs, n)
        if busy + idle > budget:
            return n - 1
    return MAX_TARGETS


# ---------------------------------------------------------------------------------- auto gamma


def at_gamma(inputs: ModelInputs, gamma: int) -> ModelInputs:
    """The inputs with proposals of ``gamma`` tokens (>= 1): the curve's S(B, gamma); the
    one-at-a-time S(1) scaled as one feed plus gamma - 1 decode steps of equal cost; the verify
    moved along ``verify_per_token_s`` (see the module docstring)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1 here, got {gamma}")
    verify = inputs.verify_s + (gamma - inputs.gamma) * inputs.verify_per_token_s
    return dataclasses.replace(
        inputs,
        gamma=gamma,
        draft_s=inputs.draft_s * gamma / inputs.gamma,
        verify_s=max(verify, 0.0),
    )


def predict_at(inputs: ModelInputs, n_targets: int, gamma: int) -> Prediction:
    """:func:`predict` with proposals of ``gamma`` tokens; gamma 0: every target alone."""
    if gamma == 0:
        step = inputs.target_step_s
        return Prediction(n_targets, "alone", step, step, n_targets / step, 1.0 / step, 0.0, 0, 0)
    return predict(at_gamma(inputs, gamma), n_targets)


def auto_gamma(inputs: ModelInputs, n_targets: int, max_gamma: int = 16) -> tuple[int, Prediction]:
    """The gamma ``--gamma auto`` settles at for ``n_targets`` alike targets, and its
    prediction (see the module docstring)."""
    expected = [expected_tokens_per_round(inputs.alpha, g) for g in range(max_gamma + 1)]
    first = batch_sizes(n_targets, inputs.max_batch)[0]  # B_1 of a speculating round
    at = [inputs] + [at_gamma(inputs, g) for g in range(1, max_gamma + 1)]  # index g
    costs = [0.0] + [service_s(a, first) for a in at[1:]]
    outside = [round_trip_outside_hub(a) for a in at]  # R(g)
    gamma, visited = min(inputs.gamma, max_gamma), list[int]()
    while gamma not in visited:
        visited.append(gamma)
        p = predict_at(inputs, n_targets, gamma)
        loaded = p.regime == "fully-loaded"
        wait = 0.0  # under-loaded (or alone): a job's batch starts as it arrives
        if loaded:  # the queue: what is left of the cycle besides its batch and R
            wait = max(p.iteration_s - costs[gamma] - outside[gamma], 0.0)
        waited = [wait + r for r in outside]
        gamma = best_gamma(expected, costs, waited, inputs.target_step_s, first, loaded)
    cycle = visited[visited.index(gamma) :]
    best = max(cycle, key=lambda g: (predict_at(inputs, n_targets, g).system_tokens_per_s, -g))
    return best, predict_at(inputs, n_targets, best)


def inputs_as_json(inputs: ModelInputs) -> dict[str, Any]:
    """The ``model_inputs`` object of a benchmark JSON: the fields, with the curve as
    ``service_curve``, a list of [B, S(B) seconds] at the inputs' gamma (absent for the
    one-at-a-time hub)."""
    raw = dataclasses.asdict(inputs)
    raw.pop("curve")
    if inputs.curve is not None:
        raw["service_curve"] = [list(point) for point in inputs.curve.table(inputs.gamma)]
    return raw


def inputs_from_json(raw: dict[str, Any]) -> ModelInputs:
    """Inverse of :func:`inputs_as_json`; also reads JSON from before the curve (no
    ``max_batch``, no curve) and ``dataclasses.asdict`` output (``curve: {sizes, first, step}``,
    or an older ``curve: {points}``)."""
    raw = dict(raw)
    points = raw.pop("service_curve", None)
    legacy = raw.pop("curve", None)
    if points is None and legacy is not None and "points" in legacy:  # the older curve
        points = legacy["points"]
    curve = ServiceCurve.proportional(points, raw["gamma"]) if points else None
    if legacy is not None and "sizes" in legacy:  # dataclasses.asdict of this one
        curve = ServiceCurve(*(tuple(legacy[k]) for k in ("sizes", "first", "step")))
    tree = raw.pop("tree", None)
    return ModelInputs(**raw, curve=curve, tree=None if tree is None else TreeRound(**tree))


def inputs_from_bench(path: str | Path) -> ModelInputs:
    """Model inputs recorded by scripts.bench.run (its ``model_inputs`` object)."""
    return inputs_from_json(json.loads(Path(path).read_text())["model_inputs"])


# ---------------------------------------------------------------------------------- output
