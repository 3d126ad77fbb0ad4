"""The scale suite's draft-length part: fixed gammas against ``--gamma auto``, and an acceptance
switch, with emulated targets against the real hub (run by ``scripts/bench/scale.py``).

* **Fixed vs auto.** At each N, emulated targets that OPEN with gamma 1, 2, 4 and 8 (the batched
  hub of the sweep keeps an OPEN's gamma) and with gamma 0 against a hub under ``--gamma auto``
  (the hub's choice every round), the five runs back to back, their order rotating from one N
  to the next, then again in the reverse order (:data:`REPEATS`), each mode's median (of two:
  mean) at one N counting (:func:`merge_reports`): this machine's speed drifts up to 3x within
  minutes, and one 2 s window per mode read fixed gamma 4 at 575 tok/s where 1, 2 and 8 read
  374-400 (two runs of one mode at N = 8 read 596 and 714 a minute apart), and the best of
  four single readings is biased up; a mirrored pair puts every mode at the same mean
  position, so that a steady drift hits all alike. The emulated target costs what a
  target's forward does: a verify of g tokens takes ``auto_verify_ms +
  auto_verify_per_token_ms * g``, and a span the hub asks it to decode alone (gamma 0)
  ``auto_verify_ms`` per token. Target: auto's system throughput at least 0.95x the best fixed
  gamma's at every N.
* **Acceptance switch.** A few emulated targets at gamma 0 on the auto hub, their acceptance
  rate switching from 0.9 to 0.3 half-way through the run; each session's proposal lengths
  round by round, and the rounds after the switch until the gamma the hub chooses settles
  (:func:`settle_rounds`; target: within 50 rounds per session).
* **The model beside them**: :func:`starsd.analytic.auto_gamma` (the same rule the hub applies,
  run against the model) and :func:`starsd.analytic.predict_at` for each fixed gamma, from the
  sweep's S(B) (calibration slices, gamma 4), the link time, the measured verify time at gamma 4
  and T_alone = ``auto_verify_ms``. The model's verify grows by ``auto_verify_per_token_ms`` per
  token, as the emulated verify does, and it scales S(B) by gamma / 4.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from scripts.bench.common import BenchConfig, rotated, run_record
from starsd import analytic, plan
from starsd.profile import load_profile

FIXED_GAMMAS = (1, 2, 4, 8)
AUTO = "auto"
MODES: tuple[int | str, ...] = (*FIXED_GAMMAS, AUTO)
GAMMA_NS = (1, 2, 4, 8, 16, 32, 64, 128)
QUICK_GAMMA_NS = (1, 8, 64)  # under-loaded, near the batched hub's saturation, far past it
TARGET_RATIO = 0.95  # auto against the best fixed gamma, at every N
# each run of the comparison (--quick: ~100 s in all). The comparison's model takes S(B) from the
# sweep and the verify time from the windows, so its calibration slices only pad the window.
# Not shorter: with 1.2 s windows (and 3 repeats) auto read 0.69-0.84x at N = 64, where 64
# sessions opened at once spend a larger part of the window starting cold.
QUICK_DURATION_S, QUICK_CALIBRATION_S = 2.0, 0.1
REPEATS = 2  # each N's modes forward, then reversed (see the module doc); their median counts
# The acceptance switch: emulated targets, rates, when, how long, and the settling rule.
SWITCH_TARGETS, SWITCH_ALPHAS, SWITCH_AT = 4, (0.9, 0.3), 0.5
SWITCH_DURATION_S, SWITCH_CALIBRATION_S = (6.0, 2.0), (10.0, 2.0)  # (quick, full)
SWITCH_MAX_NEW_TOKENS = 900  # one session spans the run (the draft's context is 1024)
SETTLE_LIMIT = 50  # rounds after the switch (the target)
SETTLE_TAIL, SETTLE_TOLERANCE = 4, 1  # the settled gamma: median of the last 4 choices, +-1

Emulate = Callable[[int, str, Sequence[str]], dict]  # (n, tag, extra args) -> report


def mode_name(mode: int | str) -> str:
    """A record's mode for one gamma mode."""
    return f"gamma-{mode}" if mode == AUTO else f"gamma-fixed-{mode}"


def gamma_order(
    ns: Sequence[int], modes: Sequence[int | str] = MODES, repeats: int = 1
) -> list[tuple[int, int | str]]:
    """(N, mode) in run order: every mode at every N, the order rotating by one per N; with
    ``repeats``, each N's order again, every other time reversed (ABCDE EDCBA ABCDE ...)."""
    order = []
    for i, n in enumerate(ns):
        once = [(n, m) for m in rotated(modes, i)]
        for r in range(repeats):
            order += once if r % 2 == 0 else once[::-1]
    return order


def merge_reports(runs: Sequence[dict]) -> dict:
    """One report for several runs of one mode at one N: every number their median (of an
    even count, the mean of the middle two), gamma counts summed, the rest the first run's;
    ``runs_tokens_per_s`` keeps each run's figure."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if key == "gamma_counts":
            out[key] = {
                g: sum((v or {}).get(g, 0) for v in values)
                for g in sorted({g for v in values for g in (v or {})}, key=int)
            }
        elif (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and all(isinstance(v, int | float) for v in values)
        ):
            out[key] = statistics.median(values)
    out["n_targets"] = runs[0]["n_targets"]
    out["runs_tokens_per_s"] = [r["system_tokens_per_s"] for r in runs]
    return out


def target_args(cfg: BenchConfig) -> list[str]:
    """Emulator options for a target that costs what a real forward does (see module doc)."""
    return [
        "--verify-ms",
        str(cfg.auto_verify_ms),
        "--verify-ms-per-token",
        str(cfg.auto_verify_per_token_ms),
        "--alone-step-ms",
        str(cfg.auto_verify_ms),
    ]


def run_comparison(cfg: BenchConfig, fixed: Emulate, auto: Emulate) -> dict[str, list[dict]]:
    """Every (N, mode) of :func:`gamma_order`: fixed gammas through ``fixed`` (the batched
    hub), gamma 0 through ``auto`` (the auto hub); reports by mode name."""
    ns = QUICK_GAMMA_NS if cfg.quick else GAMMA_NS
    timing = (
        ["--duration", str(QUICK_DURATION_S), "--calibration", str(QUICK_CALIBRATION_S)]
        if cfg.quick
        else []
    )
    runs: dict[tuple[str, int], list[dict]] = {}
    for n, mode in gamma_order(ns, repeats=REPEATS):
        gamma = 0 if mode == AUTO else int(mode)
        run = auto if mode == AUTO else fixed
        report = run(n, f"-{mode_name(mode)}", [*target_args(cfg), "--gamma", str(gamma), *timing])
        runs.setdefault((mode_name(mode), n), []).append(report)
        print(
            f"[gamma] {mode_name(mode)}, {n} emulated targets: "
            f"{report['system_tokens_per_s']:.0f} tok/s, mean gamma {report['mean_gamma']:.2f}, "
            f"alone {_alone_fraction(report):.2f} of rounds, busy "
            f"{report['hub_busy_fraction']:.2f}",
            flush=True,
        )
    reports: dict[str, list[dict]] = {mode_name(m): [] for m in MODES}
    for (name, _), same in runs.items():
        reports[name].append(merge_reports(same))
    return reports


def run_switch(cfg: BenchConfig, auto: Emulate) -> dict:
    """The acceptance switch on the auto hub; the emulator's report with its gamma trace."""
    before, after = SWITCH_ALPHAS
    duration, calibration = SWITCH_DURATION_S if cfg.quick else SWITCH_CALIBRATION_S
    print(
        f"[gamma] acceptance {before} -> {after} at {SWITCH_AT:.0%} of the run, "
        f"{SWITCH_TARGETS} emulated targets under --gamma auto ...",
        flush=True,
    )
    return auto(
        SWITCH_TARGETS,
        "-switch",
        [
            *target_args(cfg),
            "--gamma",
            "0",
            "--alpha",
            str(before),
            "--alpha-switch",
            str(after),
            "--switch-at",
            str(SWITCH_AT),
            "--duration",
            str(duration),
            "--calibration",
            str(calibration),
            "--max-new-tokens",
            str(SWITCH_MAX_NEW_TOKENS),
        ],
    )


# ---------------------------------------------------------------------- the model


def model_inputs(
    cfg: BenchConfig, base: analytic.ModelInputs | None, reports: dict[str, list[dict]]
) -> analytic.ModelInputs | None:
    """The model's inputs for the comparison: the sweep's batched-hub inputs (S(B) at gamma 4,
    link) with the comparison's target: verify at gamma 4 as measured in its fixed-4 runs, its
    growth per draft token and T_alone those the emulated targets were given (auto_verify_ms
    and auto_verify_per_token_ms; under a target profile, its V(1, g) slope and T(1))."""
    if base is None:
        return None
    fours = reports.get(mode_name(4)) or []
    verify = [r["verify_ms"] for r in fours if r.get("verify_ms")]
    verify_ms = (
        statistics.median(verify)
        if verify
        else (cfg.auto_verify_ms + base.gamma * cfg.auto_verify_per_token_ms)
    )
    step_s, per_token_s = emulated_target_costs(cfg)
    return replace(
        base,
        alpha=cfg.alpha,
        verify_s=verify_ms / 1e3,
        target_step_s=step_s,
        verify_per_token_s=per_token_s,
    )


def emulated_target_costs(cfg: BenchConfig) -> tuple[float, float]:
    """(a token decoded alone, the verify's growth per draft token) in seconds, as the
    comparison's emulated targets take them: the target profile's T(1) and V(1, g) slope when
    the suite replays one, else auto_verify_ms and auto_verify_per_token_ms."""
    if cfg.target_profile:
        target = load_profile(cfg.target_profile, "target")
        return target.seconds("step_ms")[(1, 0)], plan.verify_slope(target)
    return cfg.auto_verify_ms / 1e3, cfg.auto_verify_per_token_ms / 1e3


def model_at(inputs: analytic.ModelInputs, n: int, alpha: float | None = None) -> dict[str, Any]:
    """The model for ``n`` targets: each fixed gamma's throughput, the best of them, and the
    gamma auto settles at with its throughput."""
    if alpha is not None:
        inputs = replace(inputs, alpha=alpha)
    fixed = {str(g): analytic.predict_at(inputs, n, g).system_tokens_per_s for g in FIXED_GAMMAS}
    gamma, prediction = analytic.auto_gamma(inputs, n)
    return {
        "fixed_tokens_per_s": fixed,
        "best_fixed": int(max(fixed, key=fixed.__getitem__)),
        "auto_gamma": gamma,
        "auto_tokens_per_s": prediction.system_tokens_per_s,
        "auto_regime": prediction.regime,
    }


# ---------------------------------------------------------------------- summaries


def _alone_fraction(report: dict) -> float:
    counts = report.get("gamma_counts") or {}
    total = sum(counts.values())
    return counts.get("0", 0) / total if total else 0.0


def records(reports: dict[str, list[dict]], inputs: analytic.ModelInputs | None) -> list[dict]:
    """One ``runs`` record per (mode, N), the model's prediction for that mode beside it."""
    out = []
    for mode in MODES:
        for r in reports.get(mode_name(mode), []):
            n = r["n_targets"]
            predicted = None
            if inputs is not None:
                model = model_at(inputs, n)
                predicted = (
                    model["auto_tokens_per_s"]
                    if mode == AUTO
                    else model["fixed_tokens_per_s"][str(mode)]
                )
            out.append(
                run_record(
                    mode_name(mode),
                    n,
                    system_tokens_per_s=r["system_tokens_per_s"],
                    per_target_tokens_per_s=r["per_target_tokens_per_s"],
                    predicted_system_tokens_per_s=predicted,
                    hub_busy_fraction=r["hub_busy_fraction"],
                    acceptance_rate=r["acceptance_rate"],
                    mean_accepted=r["mean_accepted"],
                    latency_ms=r["latency_ms"],
                    bytes_per_round=r["bytes_per_round"],
                    queue_wait_ms=r["queue_wait_ms"],
                    gamma=mode,
                    mean_gamma=r["mean_gamma"],
                    gamma_counts=r["gamma_counts"],
                    alone_fraction=_alone_fraction(r),
                    alone_tokens=r["alone_tokens"],
                    mean_batch_size=r.get("mean_batch_size"),
                    verify_ms=r["verify_ms"],
                    proposal_wait_ms=r.get("proposal_wait_ms"),
                    emulator_cpu_fraction=r.get("emulator_cpu_fraction"),
                    load_generator_ms_per_round=r.get("load_generator_ms_per_round"),
                )
            )
    return out


def compare(reports: dict[str, list[dict]], inputs: analytic.ModelInputs | None) -> dict:
    """Per N: every mode's throughput, the best fixed gamma, auto over it, the model's view."""
    by_n: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        for r in reports.get(mode_name(mode), []):
            row = by_n.setdefault(str(r["n_targets"]), {"tokens_per_s": {}})
            row["tokens_per_s"][str(mode)] = r["system_tokens_per_s"]
            row.setdefault("runs_tokens_per_s", {})[str(mode)] = r.get("runs_tokens_per_s")
            if mode == AUTO:
                row.update(
                    auto_mean_gamma=r["mean_gamma"],
                    auto_gamma_counts=r["gamma_counts"],
                    auto_alone_fraction=_alone_fraction(r),
                )
    for n, row in by_n.items():
        rates = row["tokens_per_s"]
        fixed = {g: rates[str(g)] for g in FIXED_GAMMAS if str(g) in rates}
        if fixed and AUTO in rates:
            best = max(fixed, key=fixed.__getitem__)
            row.update(best_fixed=best, auto_over_best_fixed=rates[AUTO] / fixed[best])
            row["ok"] = row["auto_over_best_fixed"] >= TARGET_RATIO
        if inputs is not None:
            row["model"] = model_at(inputs, int(n))
    ratios = [row["auto_over_best_fixed"] for row in by_n.values() if "auto_over_best_fixed" in row]
    return {
        "by_n": dict(sorted(by_n.items(), key=lambda kv: int(kv[0]))),
        "target_ratio": TARGET_RATIO,
        "min_auto_over_best_fixed": min(ratios, default=None),
        "all_ok": bool(ratios) and min(ratios) >= TARGET_RATIO,
    }


def settle_rounds(
    gammas: Sequence[int],
    switch_round: int | None,
    tail: int = SETTLE_TAIL,
    tolerance: int = SETTLE_TOLERANCE,
) -> int | None:
    """Rounds after the switch until the chosen gamma settles, or None if the trace cannot tell
    (no switch inside it, fewer than ``tail`` chosen rounds after it, or still moving at its
    end).

    Probes do not count: a round right after a span alone (gamma 0) is the policy's deliberate
    re-estimate, not its choice. The settled gamma is the median of the last ``tail`` chosen
    rounds; the trace has settled at the first chosen round after the switch from which every
    later chosen round is within ``tolerance`` of it.
    """
    if switch_round is None:
        return None
    after = [(i, g) for i, g in _choices(gammas) if i >= switch_round]
    if len(after) < tail:
        return None
    final = statistics.median(g for _, g in after[-tail:])
    settled = None
    for i, g in reversed(after):
        if abs(g - final) > tolerance:
            break
        settled = i
    return None if settled is None else settled - switch_round


def _choices(gammas: Sequence[int]) -> list[tuple[int, int]]:
    """(round, gamma) of the rounds that are the policy's choice (probes left out)."""
    return [(i, g) for i, g in enumerate(gammas) if not (i > 0 and gammas[i - 1] == 0)]


def switch_summary(report: dict, inputs: analytic.ModelInputs | None) -> dict:
    """Each session that spans the switch: its gammas, where the switch fell, what it chose
    before and after, the rounds until it settled; the worst and the median over sessions."""
    sessions = []
    for trace in report.get("gamma_trace", []):
        gammas, at = trace["gammas"], trace["switch_round"]
        if at is None or at == 0:  # ended before the switch, or opened after it
            continue
        chosen = _choices(gammas)
        before = [g for i, g in chosen if i < at]
        after = [g for i, g in chosen if i >= at]
        settle = settle_rounds(gammas, at)
        gamma_before = statistics.median(before[-10:]) if before else None
        gamma_after = statistics.median(after[-SETTLE_TAIL:]) if after else None
        # already at its new choice when the switch came (e.g. decoding alone) and there since:
        # nothing to settle, even when the few long spans after it are too few to tell
        unchanged = (
            settle is None
            and gamma_after is not None
            and bool(before)
            and all(abs(g - gamma_after) <= SETTLE_TOLERANCE for g in [before[-1], *after])
        )
        sessions.append(
            {
                "target": trace["target"],
                "rounds": len(gammas),
                "switch_round": at,
                "gamma_before": gamma_before,
                "gamma_after": gamma_after,
                "settle_rounds": 0 if unchanged else settle,
                "unchanged": unchanged,
                "gammas": gammas,
            }
        )
    settled = [s["settle_rounds"] for s in sessions if s["settle_rounds"] is not None]
    out = {
        "n_targets": report["n_targets"],
        "alphas": list(SWITCH_ALPHAS),
        "switch_at": SWITCH_AT,
        "sessions": sessions,
        "settle_limit": SETTLE_LIMIT,
        "max_settle_rounds": max(settled, default=None),
        "median_settle_rounds": statistics.median(settled) if settled else None,
        "unsettled_sessions": len(sessions) - len(settled),
        "all_within_limit": bool(settled)
        and len(settled) == len(sessions)
        and max(settled) <= SETTLE_LIMIT,
    }
    if inputs is not None:
        out["model_auto_gamma"] = {
            str(a): model_at(inputs, report["n_targets"], a)["auto_gamma"] for a in SWITCH_ALPHAS
        }
    return out


def markdown(result: dict) -> list[str]:
    """The comparison's table and the switch's summary, as markdown lines."""
    gamma = result.get("gamma_comparison")
    if not gamma:
        return []
    heads = [str(m) for m in MODES]
    lines = [
        "",
        "| N | "
        + " | ".join(f"gamma {h} tok/s" for h in heads)
        + " | auto / best fixed | auto mean gamma (alone) | model: auto gamma, tok/s |",
        "|---" * (len(heads) + 4) + "|",
    ]
    for n, row in gamma["by_n"].items():
        rates = row["tokens_per_s"]
        model = row.get("model") or {}
        cells = [f"{rates[h]:.0f}" if h in rates else "-" for h in heads]
        lines.append(
            f"| {n} | "
            + " | ".join(cells)
            + f" | {row.get('auto_over_best_fixed', 0):.3f} (best {row.get('best_fixed')}) | "
            f"{row.get('auto_mean_gamma', 0):.2f} ({row.get('auto_alone_fraction', 0):.2f}) | "
            f"{model.get('auto_gamma', '-')}, {model.get('auto_tokens_per_s', 0):.0f} |"
        )
    lines.append(
        f"* auto / best fixed gamma: least {gamma['min_auto_over_best_fixed'] or 0:.3f}"
        f" (target >= {gamma['target_ratio']}): "
        f"{'met' if gamma['all_ok'] else 'missed'}"
    )
    switch = result.get("alpha_switch")
    if switch:
        lines.append(
            f"* acceptance {switch['alphas'][0]} -> {switch['alphas'][1]}: rounds to settle per "
            f"session {[s['settle_rounds'] for s in switch['sessions']]} (limit "
            f"{switch['settle_limit']}); gamma before/after "
            f"{[(s['gamma_before'], s['gamma_after']) for s in switch['sessions']]}; model "
            f"{switch.get('model_auto_gamma')}"
        )
    return lines


def plot(gamma: dict, ax: Any) -> None:
    """System tokens/s against N for each fixed gamma and for auto; the model's auto dashed."""
    ns = sorted(gamma["by_n"], key=int)
    xs = [int(n) for n in ns]
    for mode in MODES:
        key = str(mode)
        ys = [gamma["by_n"][n]["tokens_per_s"].get(key) for n in ns]
        ax.plot(
            xs,
            ys,
            "o-" if mode == AUTO else ".-",
            lw=2.5 if mode == AUTO else 1,
            label=f"gamma {mode}",
        )
    modelled = [gamma["by_n"][n].get("model", {}).get("auto_tokens_per_s") for n in ns]
    if any(m is not None for m in modelled):
        ax.plot(xs, modelled, "k--", lw=1, label="model: auto")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="emulated targets N",
        ylabel="system tokens/s",
        title="fixed gamma vs --gamma auto",
    )
    ax.legend(fontsize=8)
