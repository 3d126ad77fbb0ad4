"""``starsd plan``: the analytic model (:mod:`starsd.analytic`) with its inputs read from profiles.

Inputs, per target kind: S(B, g) from the draft profile as a :class:`~starsd.service.ServiceCurve`
(per measured B, a least-squares fit of S(B, g) = a(B) + (g - 1) b(B) over the measured gammas,
a and b >= 0; one gamma: a = b = S / g, as the analytic model's own curves); T_ar = T(1) and
verify = V(1, g_ref) from the target profile, moved at other gammas along the least-squares
slope of V(1, g) over the profile's gammas (``verify_per_token_s``: the hub fits its sessions'
round trips against gamma the same way); the link's round trip from a link profile or
``--link-ms``; alpha from ``--alpha`` or an acceptance file. g_ref is the gamma measured in every
profile closest to the hub's starting gamma (4).

Gamma: the hub's rule itself, :func:`starsd.analytic.auto_gamma` (which asks
:func:`starsd.goodput.best_gamma`), or a fixed ``--gamma``. Throughputs are
:func:`starsd.analytic.predict` at that gamma: no second model here.

Round shape (``--tree auto``, the hub's default): the chain at that gamma or one of the hub's
tree sizes (:func:`starsd.tree_shapes.tree_ladder` of ``--tree-width/-depth/-nodes``), as
:func:`starsd.analytic.pick_shape` says: chains when the hub would be fully loaded, else the
shape that makes a target the most tokens per second. A tree's inputs: its E[L]
(:func:`starsd.analytic.expected_tree_tokens` over :func:`starsd.tree_shapes.ranked_tree`, with
``--sibling-alpha`` for a node's later children), the hub's cost of growing it (a(B) + (depth - 1)
b(B x width), :meth:`starsd.service.ServiceCurve.tree_at`) and the target's verification of its
nodes, V(1, nodes) interpolated on the profile's gammas. Sizing (N_full, break-even) stays with
chains: a hub that fills drafts chains.

A mixed fleet (several target kinds, COUNT each): for N targets on one hub, kind k holds the
share c_k / C of them, the hub's batches are formed from all N whatever their kind, and kind k's
figures are ``predict`` of kind k's inputs at N: as if every target cycled like kind k. Where
every kind's prediction is fully loaded that is exact (the iteration is then the hub's busy
time, the same for every kind); elsewhere it is an approximation (a faster kind's rounds meet
batches formed partly of slower ones: the hub's load is understated in a slow kind's figures
and overstated in a fast kind's). System tokens/s sums the kinds: sum_k (c_k / C) N
per-target_k.

Sizing, per kind, scanning N = 1, 2, ... with the gamma the hub would use at each N: N_full, the
first N at which the hub is fully loaded (from there its throughput is fixed and more targets only
queue), and the break-even N, the last N before the policy turns speculation off (gamma 0) or a
target falls below its speed alone; with ``hub_rounds_per_s`` (what the hub's message path
carries, measured by ``scripts/bench/hub_flood.py``) also the message bound, the last N whose
rounds a second stay within it. That path is serial (one GIL), so it also costs every round:
each round's messages take 1 / hub_rounds_per_s of it, and a batch's last job reaches the hub
(B - 1) of those after its first (the model's ``per_message_s``); a drafter profiled on a CPU
computes on the cores that path runs on, so a batch of B is served in S(B) + B of those
(``messages_share_drafter``). A hub is worth its targets
up to N_hub = min(N_full, break-even, message bound) of every kind; the fleet of C targets
needs ceil(C / N_hub) hubs (0 when speculation does not pay even for one target). Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starsd import analytic
from starsd.profile import Profile, ProfileError, interpolate
from starsd.service import ServiceCurve
from starsd.tree_shapes import TreeShape, ranked_tree

HUB_MAX_BATCH = 64  # the hub's --max-batch default (HubConfig.max_batch)
HUB_START_GAMMA = 4  # the gamma an auto hub starts sessions at (starsd.hub.config)
HUB_TREE = TreeShape(2, 4, 8)  # the hub's --tree-width/-depth/-nodes defaults (HubConfig)
SIZING_LIMIT = 4096  # how far sizing scans N


@dataclass(frozen=True)
class Kind:
    """One target kind of the fleet: its profile, how many, and the model's inputs for it."""

    profile: Profile
    count: int
    inputs: analytic.ModelInputs

    @property
    def alone_tokens_per_s(self) -> float:
        """1 / T(1): one target decoding alone."""
        return 1.0 / self.inputs.target_step_s


@dataclass(frozen=True)
class Plan:
    """A fleet to plan for: the draft profile, the kinds, and the sweep's settings."""

    draft: Profile
    kinds: tuple[Kind, ...]
    gamma: int | None  # None: the hub's auto gamma
    max_gamma: int
    link_note: str
    notes: tuple[str, ...] = ()
    trees: tuple[TreeShape, ...] = ()  # the hub's tree sizes (--tree auto); (): chains only
    sibling_alpha: float = analytic.SIBLING_ALPHA
    # what the hub's message path carries (rounds a second, all targets together: its Python
    # threads' CPU per round, serialised by one GIL; scripts/bench/hub_flood.py); None: unbounded
    hub_rounds_per_s: float | None = None

    @property
    def fleet(self) -> int:
        """C: the targets of every kind."""
        return sum(k.count for k in self.kinds)


# ---------------------------------------------------------------------------------- inputs


def service_curve(draft: Profile) -> ServiceCurve:
    """S(B, g) = a(B) + (g - 1) b(B), fitted per measured B (see the module docstring)."""
    points = draft.seconds("service_ms")
    sizes = draft.batches("service_ms")
    gammas = draft.gammas("service_ms")
    fits = [_fit([(g, points[(b, g)]) for g in gammas]) for b in sizes]
    return ServiceCurve(tuple(sizes), tuple(a for a, _ in fits), tuple(s for _, s in fits))


def _fit(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of S = a + (g - 1) b by least squares, both >= 0; one sample: a = b = S / g."""
    if len(samples) == 1:
        g, s = samples[0]
        return s / g, s / g
    xs, ys = [g - 1.0 for g, _ in samples], [s for _, s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = max(slope / sum((x - mx) ** 2 for x in xs), 0.0)
    return max(my - slope * mx, 0.0), slope


def reference_gamma(draft: Profile, targets: Sequence[Profile]) -> int:
    """The gamma measured in every profile closest to the hub's starting gamma."""
    common = set(draft.gammas("service_ms"))
    for target in targets:
        mine = set(target.gammas("verify_ms"))
        if not common & mine:
            raise ProfileError(
                f"{target.path}: grid.verify_ms: no gamma in common with {draft.path}'s "
                f"grid.service_ms ({sorted(common)} there, {sorted(mine)} here)"
            )
        common &= mine
    return min(common, key=lambda g: (abs(g - HUB_START_GAMMA), g))


def kind_inputs(
    curve: ServiceCurve,
    target: Profile,
    alpha: float,
    link_s: float,
    max_batch: int,
    gamma: int,
    per_message_s: float = 0.0,
    messages_share_drafter: bool = False,
) -> analytic.ModelInputs:
    """The analytic model's inputs for one target kind at the reference ``gamma``;
    ``per_message_s``: the hub's serial cost per round's messages (1 / hub_rounds_per_s);
    ``messages_share_drafter``: the drafter computes on the hub's CPU (:func:`drafts_on_cpu`)."""
    return analytic.ModelInputs(
        alpha=alpha,
        gamma=gamma,
        draft_s=curve.at(1, gamma),
        verify_s=target.seconds("verify_ms")[(1, gamma)],
        link_s=link_s,
        target_step_s=target.seconds("step_ms")[(1, 0)],
        max_batch=max_batch,
        curve=curve,
        verify_per_token_s=verify_slope(target),
        per_message_s=per_message_s,
        messages_share_drafter=messages_share_drafter,
    )


def drafts_on_cpu(draft: Profile) -> bool:
    """Whether the draft profile was measured on a CPU: such a drafter computes on the cores
    the hub's event loop handles messages on, and the two take turns (a GPU drafter waits on
    its device while the loop runs)."""
    return draft.device == "cpu"


def verify_slope(target: Profile) -> float:
    """dV/dg of V(1, g) by least squares over the profile's gammas, >= 0 (one gamma: 0), as
    the hub fits its sessions' round trips against gamma."""
    verify = target.seconds("verify_ms")
    samples = sorted((g, s) for (b, g), s in verify.items() if b == 1)
    return _fit(samples)[1] if len(samples) > 1 else 0.0


def alpha_from_file(path: str | Path) -> float:
    """Alpha from an acceptance file: ``{"alpha": a}``, ``{"mean_accepted": m, "gamma": g}``
    (accepted drafts per round at g, inverted), or a benchmark JSON's ``model_inputs.alpha``."""
    where = str(path)
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{where}: cannot read acceptance: {exc}") from None
    raw = raw.get("model_inputs", raw) if isinstance(raw, dict) else {}
    if "alpha" in raw:
        alpha = raw["alpha"]
    elif "mean_accepted" in raw and "gamma" in raw:
        alpha = _inverted(raw["mean_accepted"], raw["gamma"], where)
    else:
        raise ProfileError(f"{where}: alpha: missing (or mean_accepted with gamma)")
    if not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        raise ProfileError(f"{where}: alpha: {alpha!r} is not in [0, 1]")
    return float(alpha)


def _inverted(mean_accepted: Any, gamma: Any, where: str) -> float:
    """Alpha from accepted drafts per round at ``gamma`` (ProfileError if not numbers)."""
    ok = isinstance(mean_accepted, int | float) and isinstance(gamma, int) and gamma >= 1
    if not ok or not 0 <= mean_accepted <= gamma:
        raise ProfileError(f"{where}: mean_accepted: {mean_accepted!r} at gamma {gamma!r}")
    return analytic.alpha_from_mean_accepted(float(mean_accepted), gamma)


def batch_note(curve: ServiceCurve, max_batch: int, max_n: int) -> str | None:
    """What the sweep reads of S(B) that was not measured (None: nothing)."""
    used = range(1, min(max_batch, max_n) + 1)
    between = [b for b in used if b not in curve.sizes and b < curve.sizes[-1]]
    beyond = [b for b in used if b > curve.sizes[-1]]
    parts = []
    if between:
        parts.append(f"interpolated (linear in B) at {_ranges(between)}")
    if beyond:
        parts.append(
            f"extrapolated at {_ranges(beyond)} along the line of the two largest measured "
            "sizes, never below the largest's"
        )
    if not parts:
        return None
    return f"S(B) measured at B = {list(curve.sizes)}; " + "; ".join(parts)


def _ranges(values: Sequence[int]) -> str:
    """``[2, 3, 5, 6, 7]`` -> ``"3..3, 5..7"``-style runs, compactly."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs)


# ---------------------------------------------------------------------------------- the sweep


def sweep(max_n: int) -> list[int]:
    """N = 1, 2, 4, ... (doubling), ending at ``max_n``."""
    ns, n = [], 1
    while n < max_n:
        ns.append(n)
        n *= 2
    return [*ns, max_n]


def choose(plan: Plan, kind: Kind, n: int) -> tuple[int, analytic.Prediction]:
    """The gamma the hub would use for ``n`` targets (its rule, or the fixed one) and
    :func:`starsd.analytic.predict` there."""
    if plan.gamma is None:
        return analytic.auto_gamma(kind.inputs, n, plan.max_gamma)
    return plan.gamma, analytic.predict_at(kind.inputs, n, plan.gamma)


def tree_inputs(plan: Plan, kind: Kind, shape: TreeShape) -> analytic.ModelInputs:
    """``kind``'s inputs for rounds that draft ``shape``'s tree (see the module docstring)."""
    _, parents = ranked_tree(shape)
    tokens = analytic.expected_tree_tokens(kind.inputs.alpha, plan.sibling_alpha, parents)
    verify = kind.profile.seconds("verify_ms")
    points = sorted((g, s) for (b, g), s in verify.items() if b == 1)
    return dataclasses.replace(
        kind.inputs,
        tree=analytic.TreeRound(shape.width, shape.depth, tokens),
        verify_s=interpolate(points, len(parents)),
    )


def choose_shape(plan: Plan, kind: Kind, n: int) -> tuple[str, int, analytic.Prediction]:
    """The round shape (``"chain"``, a tree's ``"tree WxD/N"``, or ``"alone"`` at gamma 0), the
    gamma and the prediction the hub would settle on for ``n`` targets (module docstring)."""
    gamma, chain = choose(plan, kind, n)
    if gamma == 0:
        return "alone", gamma, chain
    if not plan.trees:
        return "chain", gamma, chain
    trees = [analytic.predict(tree_inputs(plan, kind, shape), n) for shape in plan.trees]
    pick = analytic.pick_shape(chain, trees)
    if pick == 0:
        return "chain", gamma, chain
    return shape_name(plan.trees[pick - 1]), gamma, trees[pick - 1]


def shape_name(shape: TreeShape) -> str:
    """``tree 2x4/8``: width x depth / node budget."""
    return f"tree {shape.width}x{shape.depth}/{shape.nodes}"


def rows(plan: Plan, ns: Sequence[int]) -> list[dict[str, Any]]:
    """One row per N and kind, plus a fleet row per N when there are several kinds."""
    out = []
    for n in ns:
        mine = [_row(plan, kind, n) for kind in plan.kinds]
        out.extend(mine)
        if len(mine) > 1:
            out.append(_fleet_row(n, mine))
    return out


def _row(plan: Plan, kind: Kind, n: int) -> dict[str, Any]:
    shape, gamma, p = choose_shape(plan, kind, n)
    share = kind.count / plan.fleet
    return {
        "n": n,
        "kind": kind.profile.name,
        "gamma": gamma,
        "shape": shape,
        "regime": p.regime,
        "per_target_tokens_per_s": p.per_target_tokens_per_s,
        "speedup_vs_alone": p.per_target_tokens_per_s / kind.alone_tokens_per_s,
        "system_tokens_per_s": share * n * p.per_target_tokens_per_s,
        "hub_busy": p.hub_busy_fraction,
        "batches": p.batches,
        "largest_batch": p.largest_batch,
    }


def _fleet_row(n: int, kinds: list[dict[str, Any]]) -> dict[str, Any]:
    system = sum(r["system_tokens_per_s"] for r in kinds)
    return {"n": n, "kind": "fleet", "system_tokens_per_s": system}


def sizing(plan: Plan, limit: int = SIZING_LIMIT) -> dict[str, Any]:
    """N_full and break-even per kind, and the hubs the fleet needs (module docstring)."""
    per_kind = {k.profile.name: kind_sizing(plan, k, limit) for k in plan.kinds}
    fulls = [s["n_full"] for s in per_kind.values() if s["n_full"] is not None]
    n_even = min(s["break_even_n"] for s in per_kind.values())
    bounds = [s["message_bound_n"] for s in per_kind.values() if s["message_bound_n"] is not None]
    n_hub = min([*fulls, n_even, *bounds])
    return {
        "kinds": per_kind,
        "fleet": plan.fleet,
        "n_full": min(fulls) if fulls else None,
        "break_even_n": n_even,
        "hub_rounds_per_s": plan.hub_rounds_per_s,
        "message_bound_n": min(bounds) if bounds else None,
        "targets_per_hub": n_hub,
        "hubs": math.ceil(plan.fleet / n_hub) if n_hub else 0,
        "scan_limit": limit,
    }


def kind_sizing(plan: Plan, kind: Kind, limit: int = SIZING_LIMIT) -> dict[str, Any]:
    """Scan N = 1.. with the gamma the hub would use: N_full, the first N the hub is fully
    loaded (None: not up to ``limit``, or speculation is off before), and the break-even N,
    the last N before the policy decodes alone or a target falls below its speed alone."""
    n_full = n_even = n_message = None
    for n in range(1, limit + 1):
        gamma, p = choose(plan, kind, n)
        if gamma == 0 or p.per_target_tokens_per_s < kind.alone_tokens_per_s:
            n_even = n - 1
            break
        if n_full is None and p.regime == "fully-loaded":
            n_full = n
        if n_message is None and _over_message_path(plan, n, p):
            n_message = n - 1
    return {
        "gamma_at_1": choose(plan, kind, 1)[0],
        "n_full": n_full,
        "break_even_n": limit if n_even is None else n_even,
        "message_bound_n": n_message,
        "alone_tokens_per_s": kind.alone_tokens_per_s,
    }


def _over_message_path(plan: Plan, n: int, p: analytic.Prediction) -> bool:
    """Whether ``n`` targets, one round per iteration each, ask the hub for more rounds a
    second than its message path carries."""
    return plan.hub_rounds_per_s is not None and n / p.iteration_s > plan.hub_rounds_per_s


def as_json(plan: Plan, ns: Sequence[int]) -> dict[str, Any]:
    """The plan as one JSON object: inputs per kind, rows, sizing, notes."""
    return {
        "draft": plan.draft.path,
        "gamma": plan.gamma if plan.gamma is not None else "auto",
        "max_gamma": plan.max_gamma,
        "trees": [shape_name(t) for t in plan.trees],
        "sibling_alpha": plan.sibling_alpha,
        "link": plan.link_note,
        "kinds": [
            {"profile": k.profile.path, "name": k.profile.name, "count": k.count}
            | {"model_inputs": analytic.inputs_as_json(k.inputs)}
            for k in plan.kinds
        ],
        "rows": rows(plan, ns),
        "sizing": sizing(plan),
        "notes": list(plan.notes),
    }
