"""``starsd plan``'s assembly from files and its output: the table, the JSON, the plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starsd import analytic
from starsd import plan as planning
from starsd.profile import ProfileError, check_fingerprint, load_profile
from starsd.tree_shapes import TreeShape, tree_ladder


@dataclass(frozen=True)
class PlanRequest:
    """What ``starsd plan`` was asked: files and settings (see its help)."""

    draft: str
    targets: tuple[str, ...]  # FILE or FILE:COUNT
    alpha: float = 0.7
    acceptance: str | None = None
    link: str | None = None
    link_ms: float | None = None
    max_batch: int = planning.HUB_MAX_BATCH
    gamma: int | None = None  # None: auto
    max_gamma: int | None = None  # None: the draft profile's largest gamma
    draft_model: str | None = None
    tree: str = "auto"  # "auto": the hub's tree sizes are candidates; "off": chains only
    tree_shape: TreeShape = planning.HUB_TREE  # the hub's largest tree (--tree-width/-depth/-nodes)
    sibling_alpha: float = analytic.SIBLING_ALPHA
    hub_rounds_per_s: float | None = None  # the hub's message path (None: unbounded)


def target_spec(text: str) -> tuple[str, int]:
    """``FILE`` or ``FILE:COUNT`` -> (file, count >= 1)."""
    path, sep, count = text.rpartition(":")
    if not sep or not count.isdigit():
        return text, 1
    if int(count) < 1:
        raise ProfileError(f"{path}: COUNT: {count} (want >= 1 targets of this kind)")
    return path, int(count)


def build_plan(req: PlanRequest) -> planning.Plan:
    """Load and check every file, and assemble the plan (ProfileError on bad input)."""
    draft = load_profile(req.draft, "draft")
    if req.draft_model is not None:
        check_fingerprint(draft, req.draft_model)
    specs = [target_spec(t) for t in req.targets]
    targets = [(load_profile(path, "target"), count) for path, count in specs]
    gamma = planning.reference_gamma(draft, [t for t, _ in targets])
    curve = planning.service_curve(draft)
    alpha = planning.alpha_from_file(req.acceptance) if req.acceptance else req.alpha
    link_s, link_note = _link(req)
    rounds = req.hub_rounds_per_s
    if rounds is not None and not 0.0 < rounds < float("inf"):
        raise ProfileError(f"--hub-rounds-per-s: {rounds} is not a rate > 0")
    message_s = 1.0 / rounds if rounds else 0.0  # the hub's serial cost per round's messages
    shared = planning.drafts_on_cpu(draft)
    kinds = tuple(
        planning.Kind(
            t,
            n,
            planning.kind_inputs(curve, t, alpha, link_s, req.max_batch, gamma, message_s, shared),
        )
        for t, n in targets
    )
    max_gamma = req.max_gamma or max(draft.gammas("service_ms"))
    slopes = [k.inputs.verify_per_token_s for k in kinds]
    notes = [_source_note(draft, [t for t, _ in targets]), _gamma_note(gamma, max_gamma, slopes)]
    trees = tree_ladder(req.tree_shape) if req.tree == "auto" else ()
    if not 0.0 <= req.sibling_alpha <= 1.0:
        raise ProfileError(f"--sibling-alpha: {req.sibling_alpha} is not in [0, 1]")
    return planning.Plan(
        draft,
        kinds,
        req.gamma,
        max_gamma,
        link_note,
        tuple(notes),
        trees,
        req.sibling_alpha,
        rounds,
    )


def _link(req: PlanRequest) -> tuple[float, str]:
    """(link round trip in seconds, where it came from)."""
    if req.link is not None:
        link = load_profile(req.link, "link")
        seconds = link.seconds("round_trip_ms")[(1, 0)]
        return seconds, f"{1e3 * seconds:.3f} ms (median PING/PONG, {req.link})"
    if req.link_ms is not None:
        if not req.link_ms >= 0 or req.link_ms == float("inf"):
            raise ProfileError(f"--link-ms: {req.link_ms} is not a time >= 0")
        return req.link_ms / 1e3, f"{req.link_ms:.3f} ms (--link-ms)"
    return 0.0, "0 ms (no --link or --link-ms: targets next to the hub)"


def _source_note(draft: Any, targets: Sequence[Any]) -> str:
    kinds = ", ".join(f"{p.path} ({p.source})" for p in [draft, *targets])
    return f"profiles: {kinds}"


def _gamma_note(gamma: int, max_gamma: int, slopes: Sequence[float]) -> str:
    per_token = ", ".join(f"{1e3 * s:.3f}" for s in slopes)
    return (
        f"verify V(1, g) = V(1, {gamma}) + (g - {gamma}) x {per_token} ms (least squares over "
        f"the profile's gammas); S(B, g) for g up to {max_gamma} from a(B) + (g - 1) b(B)"
    )


# ---------------------------------------------------------------------------------- output


def header(p: planning.Plan, max_n: int) -> list[str]:
    """The lines above the table: inputs, assumptions, what was not measured."""
    k0 = p.kinds[0].inputs
    lines = [
        f"draft {p.draft.name} ({p.draft.source}); hub max batch M = {k0.max_batch}; "
        f"alpha {k0.alpha:.3f}; link {p.link_note}",
        f"gamma: {_gamma_text(p)}",
        f"round shape: {_tree_text(p)}",
        f"hub message path: {_message_text(p)}",
    ]
    for k in p.kinds:
        i = k.inputs
        lines.append(
            f"target {k.profile.name} x {k.count} ({k.profile.source}): T(1) "
            f"{1e3 * i.target_step_s:.3f} ms (alone {k.alone_tokens_per_s:.1f} tok/s), "
            f"V(1, {i.gamma}) {1e3 * i.verify_s:.3f} ms; S(1, {i.gamma}) {1e3 * i.draft_s:.3f} ms"
        )
    note = planning.batch_note(k0.curve, k0.max_batch, max_n) if k0.curve else None
    return lines + [f"note: {n}" for n in (*p.notes, *([note] if note else []))]


def _message_text(p: planning.Plan) -> str:
    rounds = p.hub_rounds_per_s
    if rounds is None:
        return "taken as free (no --hub-rounds-per-s): a batch's jobs all arrive at once"
    shared = p.kinds[0].inputs.messages_share_drafter
    return (
        f"{rounds:.0f} rounds/s (--hub-rounds-per-s): {1e3 / rounds:.4f} ms of it a round, a "
        "batch of B starts (B - 1) of those after its first job"
        + ("; the CPU drafter takes turns with it: S(B) + B of those" if shared else "")
    )


def _tree_text(p: planning.Plan) -> str:
    if not p.trees:
        return "chains only (--tree off)"
    sizes = ", ".join(planning.shape_name(t) for t in p.trees)
    return (
        f"chain or {sizes} (--tree auto: chains when the hub is fully loaded; a node's later "
        f"children accepted with {p.sibling_alpha:.2f})"
    )


def _gamma_text(p: planning.Plan) -> str:
    if p.gamma is None:
        return f"auto (the hub's policy rule, starsd.goodput, over 0..{p.max_gamma})"
    return f"fixed at {p.gamma}"


def table(p: planning.Plan, ns: Sequence[int]) -> str:
    """The markdown table of the sweep."""
    lines = [
        "| N | kind | gamma | shape | regime | per-target tok/s | x alone | system tok/s "
        "| hub busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in planning.rows(p, ns):
        if r["kind"] == "fleet":
            lines.append(f"| {r['n']} | fleet | | | | | | {r['system_tokens_per_s']:.1f} | |")
            continue
        lines.append(
            f"| {r['n']} | {r['kind']} | {r['gamma']} | {r['shape']} | {r['regime']} | "
            f"{r['per_target_tokens_per_s']:.1f} | {r['speedup_vs_alone']:.2f} | "
            f"{r['system_tokens_per_s']:.1f} | {r['hub_busy']:.2f} |"
        )
    return "\n".join(lines)


def sizing_lines(p: planning.Plan) -> list[str]:
    """N_full, break-even and the hubs the fleet needs, in words."""
    s = planning.sizing(p)
    lines = [_kind_line(name, k, s["scan_limit"]) for name, k in s["kinds"].items()]
    if not s["hubs"]:
        return [*lines, f"fleet of {s['fleet']}: no hub (speculation does not pay here)"]
    lines.append(
        f"fleet of {s['fleet']}: hubs needed = ceil({s['fleet']} / N_hub {s['targets_per_hub']}) "
        f"= {s['hubs']} (N_hub = min(N_full, break-even N{_bound_term(s)}) over the kinds: more "
        "targets per hub would queue at it or run slower than alone)"
    )
    return lines


def _bound_term(s: dict[str, Any]) -> str:
    if s["hub_rounds_per_s"] is None:
        return ""
    bound = s["message_bound_n"] if s["message_bound_n"] is not None else "none"
    return f", message bound {bound} at {s['hub_rounds_per_s']:.0f} rounds/s"


def _kind_line(name: str, k: dict[str, Any], limit: int) -> str:
    full = k["n_full"] if k["n_full"] is not None else f"none up to {limit} or before break-even"
    return (
        f"{name}: N_full = {full}; break-even N = {k['break_even_n']}; "
        f"gamma for one target = {k['gamma_at_1']}"
    )


def report(p: planning.Plan, ns: Sequence[int]) -> str:
    """Everything ``starsd plan`` prints."""
    return "\n".join([*header(p, ns[-1]), "", table(p, ns), "", *sizing_lines(p)])


def write_json(p: planning.Plan, ns: Sequence[int], path: str) -> None:
    """The plan as JSON (:func:`starsd.plan.as_json`)."""
    Path(path).write_text(json.dumps(planning.as_json(p, ns), indent=2) + "\n")


def plot(p: planning.Plan, ns: Sequence[int], path: str) -> None:
    """Per-target and system tokens/s against N, per kind, with alone and N_full (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    rows = planning.rows(p, ns)
    for k in p.kinds:
        mine = [r for r in rows if r["kind"] == k.profile.name]
        xs = [r["n"] for r in mine]
        left.plot(xs, [r["per_target_tokens_per_s"] for r in mine], "o-", label=k.profile.name)
        left.axhline(k.alone_tokens_per_s, ls=":", c="grey")
        right.plot(xs, [r["system_tokens_per_s"] for r in mine], "o-", label=k.profile.name)
    sizing = planning.sizing(p)
    if sizing["n_full"] is not None:
        right.axvline(sizing["n_full"], ls="--", c="red", label="N_full")
    if sizing["targets_per_hub"]:
        right.axvline(sizing["targets_per_hub"], ls=":", c="black", label="N_hub")
    left.set(xscale="log", xlabel="targets per hub N", ylabel="tok/s", title="per target")
    right.set(xscale="log", xlabel="targets per hub N", ylabel="tok/s", title="system")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
