"""Benchmarks replayed under a profile pair, and the plan's prediction of the replay.

``make bench-scale PROFILE=DRAFT.json,TARGET.json`` (and ``make bench-hubs``): the hubs draft
with ``--draft-kind emulated`` at the draft profile's S(B, g) and the emulated targets verify at
the target profile's V(1, g) and decode alone at its T(1) (docs/planning.md). The results go to
``results/<suite>-<pair name>.json``, the pair's name being the longest common prefix of the two
files' names (``published-h100-llama31-8b`` for the published H100 pair), so the committed CPU
results stay as they are.

Beside every replayed point goes what ``starsd plan`` predicts under the same profiles
(:mod:`starsd.plan`'s inputs, :func:`starsd.analytic.predict`): alpha the emulators' draw, the
link the suite's measured loopback round trip, the hub's --max-batch, gamma the run's fixed one
(V(1, g) read at that gamma when measured) or the hub's own rule for an auto hub, and the
replay's two serial costs per message, measured in the same run (:func:`annotate`): the hub's
message path (``starsd plan --hub-rounds-per-s``) and the load generator's. The largest
relative error over the sweep is the check that the plan predicts the replay; the plan without
those costs is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from starsd import analytic, plan
from starsd.hub.config import HubConfig
from starsd.profile import (
    Profile,
    ProfileError,
    check_fingerprint,
    check_profile,
    load_profile,
    new_profile,
)

PLAN_TARGET_ERROR = 0.15  # the plan's largest error against the replayed sweep


@dataclass(frozen=True)
class ProfilePair:
    """A draft profile and a target profile, validated."""

    draft: Profile
    target: Profile

    @property
    def name(self) -> str:
        """The pair's name in output files (see :func:`pair_name`)."""
        return pair_name(self.draft.path, self.target.path)


def parse_pair(spec: str) -> ProfilePair:
    """``DRAFT.json,TARGET.json`` -> the pair; ProfileError naming the file that is unusable
    (missing, not a profile, or a profile of the other kind)."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ProfileError(f"PROFILE {spec!r}: expected DRAFT.json,TARGET.json (two files)")
    return load_pair(parts[0], parts[1])


def load_pair(draft: str, target: str) -> ProfilePair:
    """Both profiles loaded, each checked to be of its kind (ProfileError names the file)."""
    return ProfilePair(load_profile(draft, "draft"), load_profile(target, "target"))


def pair_name(draft: str, target: str) -> str:
    """The two files' names' common leading words (split at ``-``), else both names joined
    by ``+``."""
    a, b = Path(draft).stem, Path(target).stem
    common = []
    for x, y in zip(a.split("-"), b.split("-"), strict=False):
        if x != y:
            break
        common.append(x)
    return "-".join(common) or f"{a}+{b}"


def out_stem(base: str, draft: str, target: str) -> str:
    """A suite's output name: ``base`` alone, ``base-<pair name>`` when replaying profiles (a
    single profile names its own file)."""
    if draft and target:
        return f"{base}-{pair_name(draft, target)}"
    if draft or target:
        return f"{base}-{Path(draft or target).stem}"
    return base


# ---------------------------------------------------------------------------------- the plan


def plan_inputs(
    pair: ProfilePair,
    alpha: float,
    link_s: float,
    max_batch: int,
    gamma: int,
    drafter_computes: bool = False,
) -> analytic.ModelInputs:
    """``starsd plan``'s inputs for one hub: V(1, g) at ``gamma`` where both profiles measured
    it, else at the plan's reference gamma. ``drafter_computes``: the hub runs the profiled
    drafter itself, not the emulated one that sleeps (then a CPU profile's drafter shares the
    hub's CPU with its message path, as ``starsd plan`` assumes)."""
    measured = set(pair.draft.gammas("service_ms")) & set(pair.target.gammas("verify_ms"))
    ref = gamma if gamma in measured else plan.reference_gamma(pair.draft, [pair.target])
    shared = drafter_computes and plan.drafts_on_cpu(pair.draft)
    curve = plan.service_curve(pair.draft)
    inputs = plan.kind_inputs(curve, pair.target, alpha, link_s, max_batch, ref, 0.0, shared)
    return inputs if ref == gamma else analytic.at_gamma(inputs, gamma)


def predicted(inputs: analytic.ModelInputs, n: int, auto: bool = False) -> float:
    """System tokens/s the plan predicts for ``n`` targets on one hub (the hub's gamma rule
    when ``auto``)."""
    if auto:
        return analytic.auto_gamma(inputs, n, HubConfig.max_gamma)[1].system_tokens_per_s
    return analytic.predict(inputs, n).system_tokens_per_s


def error(measured: float, prediction: float) -> float:
    """Relative error of the prediction against the measurement."""
    return abs(measured / prediction - 1)


def max_error(records: Iterable[dict[str, Any]]) -> float | None:
    """The largest ``plan_error`` among ``records`` (None if none has one)."""
    errors = [r["plan_error"] for r in records if r.get("plan_error") is not None]
    return max(errors, default=None)


def annotate(
    record: dict[str, Any],
    inputs: analytic.ModelInputs,
    auto: bool,
    hub_message_s: float,
    shares: list[int] | None = None,
) -> None:
    """Put the plan's prediction of this replayed run beside it, and its error; ``shares``:
    the targets on each hub when the run spread them over several (each hub's plan, summed;
    default: all on one).

    The replay has two serial costs per message, both measured in the same run: the hub's
    message path (``hub_message_s``: 1 / the rounds a second a flooded null hub carries) and
    the load generator's own (:func:`generator_s`). A batch's messages pass through the two
    processes in turn, each handling them one after another, so the later job of a batch is
    late by the slower one's cost per message, not by both: the replay is predicted with
    ``per_message_s`` their maximum. Beside it go what the plan says for a fleet (the hub's
    message path only: real targets do not queue behind one another) and with neither cost."""
    generator = generator_s(record)
    parts = [
        predictions(inputs, n, auto, hub_message_s, generator)
        for n in (shares or [record["n_targets"]])
    ]
    record.update({key: sum(part[key] for part in parts) for key in PREDICTIONS})
    measured = record["system_tokens_per_s"]
    record["plan_error"] = error(measured, record["plan_predicted_system_tokens_per_s"])
    bare = record["plan_without_message_costs_tokens_per_s"]
    record["plan_error_without_message_costs"] = error(measured, bare)


PREDICTIONS = (
    "plan_predicted_system_tokens_per_s",  # the replay: the slower serial cost
    "plan_fleet_tokens_per_s",  # a fleet: the hub's message path only
    "plan_without_message_costs_tokens_per_s",
)


def predictions(
    inputs: analytic.ModelInputs, n: int, auto: bool, hub_s: float, generator_s: float
) -> dict[str, float]:
    """:data:`PREDICTIONS` for ``n`` targets on one hub."""
    costs = (max(hub_s, generator_s), hub_s, 0.0)
    return {
        key: predicted(replace(inputs, per_message_s=c), n, auto)
        for key, c in zip(PREDICTIONS, costs, strict=True)
    }


def generator_s(record: dict[str, Any]) -> float:
    """The load generator's serial cost per round in a replayed run: one process stands in
    for all N targets and handles a batch's proposals one after another, so the last of B
    starts verifying about (B - 1) of these late. The poller measures its own handling time
    (``load_generator_ms_per_round``); for the asyncio driver, its CPU seconds per round."""
    ms = record.get("load_generator_ms_per_round")
    if ms is not None:
        return ms / 1e3
    cpu = record.get("emulator_cpu_fraction")
    rounds = rounds_per_s(record) if cpu else 0.0
    return cpu / rounds if cpu and rounds else 0.0


def hub_message_s(rounds: float | None) -> float:
    """The hub's serial cost per message from what its message path carries (0: unknown)."""
    return 1.0 / rounds if rounds else 0.0


def check_summary(records: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The plan check over ``records``: largest error against the target, per-mode maxima."""
    worst = max_error(records)
    by_mode = {m: max_error(r for r in records if r["mode"] == m) for m in modes(records)}
    bare = [r["plan_error_without_message_costs"] for r in records]
    return {
        "max_prediction_error": worst,
        "max_prediction_error_by_mode": by_mode,
        "target_error": PLAN_TARGET_ERROR,
        "meets_target": worst is not None and worst <= PLAN_TARGET_ERROR,
        **extra,
        "max_prediction_error_without_message_costs": max(bare, default=None),
    }


def modes(records: Iterable[dict[str, Any]]) -> list[str]:
    """The records' modes, in order of first appearance."""
    return list(dict.fromkeys(r["mode"] for r in records))


# ---------------------------------------------------------------------------------- the suites


def scale_check(result: dict[str, Any], cfg: Any) -> dict[str, Any] | None:
    """The plan beside every emulated run of the scale suite (``cfg``: its BenchConfig), and
    its largest error over the batched hub's sweep; None without a plan to check (neither a
    replayed pair nor ``cfg.plan_draft_profile``).

    With the real drafter (no replayed pair) the plan reads the drafter's S(B, g) from
    ``cfg.plan_draft_profile`` and the emulated targets' costs from --verify-ms
    (:func:`emulated_targets`); only the sweep's runs are predicted (the gamma and tree
    comparisons' targets verify at other costs). A profile of another model than --draft is
    skipped, and the check says why."""
    replayed = bool(cfg.draft_profile and cfg.target_profile)
    if not replayed and not getattr(cfg, "plan_draft_profile", ""):  # (older configs lack it)
        return None
    try:
        pair = load_pair(cfg.draft_profile, cfg.target_profile) if replayed else cpu_pair(cfg)
    except ProfileError as exc:
        return {"skipped": str(exc)}
    link_s = result["link_round_ms"] / 1e3
    message_s = hub_message_s(result.get("hub_rounds_per_s"))
    annotated = []
    for record in result["runs"]:
        spec = scale_mode(record["mode"], cfg.gamma, cfg.max_batch)
        if spec is None or (not replayed and not record["mode"].startswith("emulated-")):
            continue
        max_batch, gamma, auto = spec
        inputs = plan_inputs(pair, cfg.alpha, link_s, max_batch, gamma, not replayed)
        annotate(record, inputs, auto, message_s)
        annotated.append(record)
    sweep = [r for r in annotated if r["mode"] == "emulated-batched"]
    source = "the suite's null-drafter round"
    return check_summary(
        sweep,
        max_prediction_error_all_runs=max_error(annotated),
        by_mode_all_runs={
            m: max_error(r for r in annotated if r["mode"] == m) for m in modes(annotated)
        },
        **plan_settings(pair, cfg.alpha, link_s, source, message_s),
    )


def cpu_pair(cfg: Any) -> ProfilePair:
    """The real sweep's pair: the swept drafter's profile (checked to be of --draft) and the
    emulated targets it drafted for."""
    draft = load_profile(cfg.plan_draft_profile, "draft")
    check_fingerprint(draft, cfg.draft)
    return ProfilePair(draft, emulated_targets(cfg.verify_ms, draft.gammas("service_ms")))


def emulated_targets(verify_ms: float, gammas: Iterable[int]) -> Profile:
    """The sweep's emulated targets as a target profile: a verify of any gamma and a token
    decoded alone each take ``verify_ms`` (``--verify-ms``: what they are told to wait)."""
    summary = {"median_ms": verify_ms, "p10_ms": verify_ms, "p90_ms": verify_ms, "n": 1}
    grid = {
        "step_ms": [{"batch": 1, **summary}],
        "verify_ms": [{"batch": 1, "gamma": g, **summary} for g in gammas],
    }
    model = {"name": "emulated targets", "path": ""}
    raw = new_profile("target", model, {"device": "emulated"}, grid)
    return check_profile(raw, f"the emulated targets (--verify-ms {verify_ms:g})")


def rounds_per_s(record: dict[str, Any]) -> float:
    """A run's rounds a second, all targets together (tokens over tokens per round)."""
    return record["system_tokens_per_s"] / (1 + record["mean_accepted"])


def scale_mode(mode: str, gamma: int, max_batch: int) -> tuple[int, int, bool] | None:
    """(hub --max-batch, gamma, auto) of a scale-suite record's mode; None for other records."""
    if mode == "emulated-one-at-a-time":
        return 1, gamma, False
    if mode == "emulated-batched":
        return max_batch, gamma, False
    if mode == "gamma-auto":
        return max_batch, gamma, True
    if mode.startswith("gamma-fixed-"):
        return max_batch, int(mode.rsplit("-", 1)[1]), False
    return None


def hubs_check(result: dict[str, Any], cfg: Any, out_dir: Path) -> dict | None:
    """The plan beside every run of the hubs suite's sweep (``cfg``: its HubsConfig): one hub
    with N targets, two hubs each with their share (the plan of each hub, summed); None unless
    both profiles were replayed. The link is the scale suite's loopback round trip, read from
    ``out_dir`` (this suite does not measure one)."""
    if not (cfg.draft_profile and cfg.target_profile):
        return None
    pair = load_pair(cfg.draft_profile, cfg.target_profile)
    link_ms, rounds, source = scale_suite_figures(out_dir, pair.name)
    inputs = plan_inputs(pair, cfg.alpha, link_ms / 1e3, cfg.max_batch, cfg.gamma)
    for record in result["runs"]:
        n = record["n_targets"]
        shares = [n] if record["mode"] == "one-hub" else [n - n // 2, n // 2]
        annotate(record, inputs, False, hub_message_s(rounds), [s for s in shares if s])
    ratio = hubs_ratio(result["runs"])
    return check_summary(
        result["runs"],
        plan_saturated_ratio=ratio,
        **plan_settings(pair, cfg.alpha, link_ms / 1e3, source, hub_message_s(rounds)),
    )


def hubs_ratio(runs: list[dict[str, Any]]) -> float | None:
    """The plan's two hubs over one hub at the largest N both ran."""
    best: dict[str, float] = {}
    for r in runs:
        if r["mode"] in ("one-hub", "two-hubs"):
            best[r["mode"]] = max(best.get(r["mode"], 0.0), r["plan_predicted_system_tokens_per_s"])
    if len(best) < 2:
        return None
    return best["two-hubs"] / best["one-hub"]


def plan_settings(
    pair: ProfilePair, alpha: float, link_s: float, link_source: str, message_s: float
) -> dict:
    """What the plan was given (the JSON says it, so the check can be redone)."""
    return {
        "draft_profile": pair.draft.path,
        "target_profile": pair.target.path,
        "alpha": alpha,
        "link_ms": 1e3 * link_s,
        "link_source": link_source,
        "hub_message_ms": 1e3 * message_s,
    }


def scale_suite_figures(out_dir: Path, name: str) -> tuple[float, float | None, str]:
    """(loopback round trip ms, the hub's rounds a second, where from) for a suite that
    measures neither: the scale suite's under the same pair, else its CPU run's, else
    (0, None)."""
    for path in (out_dir / f"bench-scale-{name}.json", out_dir / "bench-scale.json"):
        if path.exists():
            result = json.loads(path.read_text())
            rounds = result.get("hub_rounds_per_s")
            return float(result["link_round_ms"]), rounds, f"{path.name}'s"
    return 0.0, None, "none measured: 0"


# ---------------------------------------------------------------------------------- options

PROFILE_HELP = (
    "DRAFT.json,TARGET.json: replay the pair (emulated drafter at the draft profile's S(B, g), "
    "emulated targets at the target profile's V(1, g) and T(1)); results go to "
    "<suite>-<pair name>.json"
)


def add_profile_option(parser: argparse.ArgumentParser) -> None:
    """``--profile DRAFT.json,TARGET.json`` on a suite's parser."""
    parser.add_argument("--profile", default="", help=PROFILE_HELP)


def resolve_profiles(parser: argparse.ArgumentParser, args: dict[str, Any]) -> None:
    """Fold ``--profile`` into ``draft_profile`` / ``target_profile`` of ``args`` (removing
    it), checking every profile named; an unusable one ends the run with one line naming it."""
    spec = args.pop("profile", "")
    try:
        if spec:
            pair = parse_pair(spec)
            args.update(draft_profile=pair.draft.path, target_profile=pair.target.path)
        if args.get("draft_profile"):
            load_profile(args["draft_profile"], "draft")
        if args.get("target_profile"):
            load_profile(args["target_profile"], "target")
    except ProfileError as exc:
        parser.error(str(exc))


def report(runs: list[dict[str, Any]], check: dict[str, Any]) -> str:
    """Every annotated run beside the plan's prediction, and the largest error."""
    lines = [
        "| mode | N | measured tok/s | plan tok/s | error | plan without message costs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        if r.get("plan_error") is not None:
            lines.append(
                f"| {r['mode']} | {r['n_targets']} | {r['system_tokens_per_s']:.0f} "
                f"| {r['plan_predicted_system_tokens_per_s']:.0f} | {100 * r['plan_error']:.0f}% "
                f"| {r['plan_without_message_costs_tokens_per_s']:.0f} "
                f"({100 * r['plan_error_without_message_costs']:.0f}%) |"
            )
    worst = check["max_prediction_error"]
    bare = check["max_prediction_error_without_message_costs"]
    lines.append(
        f"plan vs replay: max error {100 * (worst or 0):.0f}% (target <= "
        f"{100 * check['target_error']:.0f}%; {100 * (bare or 0):.0f}% without the message "
        f"costs; link {check['link_ms']:.2f} ms, {check['link_source']}; the hub's message "
        f"path {check['hub_message_ms']:.3f} ms a round)"
    )
    return "\n".join(lines)
