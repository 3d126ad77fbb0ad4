"""The two-hub suite's figures: the sweep's medians and ratios, how evenly the hubs were
loaded, the fault run against the target alone, and the report (markdown, plot). Pure: what
``scripts.bench.hubs`` measured goes in, numbers come out.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

ONE, TWO, SPLIT = "one-hub", "two-hubs", "two-hubs-static"
MODES = (ONE, TWO, SPLIT)
TARGET_RATIO = 1.8  # saturated throughput with two hubs over one hub


# ---------------------------------------------------------------------- sweep summary


def median_by(runs: list[dict], mode: str, key: str = "system_tokens_per_s") -> dict[int, float]:
    """N -> the median of ``key`` over the repeats of ``mode`` at that N."""
    values: dict[int, list[float]] = {}
    for r in runs:
        if r["mode"] == mode:
            values.setdefault(r["n_targets"], []).append(r[key])
    return {n: statistics.median(v) for n, v in sorted(values.items())}


def saturated(by_n: dict[int, float]) -> tuple[int, float]:
    """(N, tok/s) of the best throughput over the sweep: the saturated system throughput."""
    n = max(by_n, key=lambda k: by_n[k])
    return n, by_n[n]


def paired_ratios(runs: list[dict], mode: str = TWO) -> dict[str, float]:
    """``mode`` over one hub per N: each repeat's pair (run back to back) first, then the median
    over the repeats."""
    one = {
        (r["repeat"], r["n_targets"]): r["system_tokens_per_s"] for r in runs if r["mode"] == ONE
    }
    ratios: dict[int, list[float]] = {}
    for r in runs:
        base = one.get((r["repeat"], r["n_targets"]))
        if r["mode"] == mode and base:
            ratios.setdefault(r["n_targets"], []).append(r["system_tokens_per_s"] / base)
    return {str(n): statistics.median(v) for n, v in sorted(ratios.items())}


def balance_summary(runs: list[dict]) -> dict[str, Any]:
    """The two-hub runs' balance: per N (one entry per repeat) the sessions placed, open
    sessions, jobs and busy fraction per hub; and the worst largest share over an even one."""
    two = [r for r in runs if r["mode"] == TWO and "hubs" in r]
    per_n: dict[str, list[dict]] = {}
    for r in two:
        per_n.setdefault(str(r["n_targets"]), []).append(
            {
                "sessions_placed": [h["sessions_placed"] for h in r["hubs"]],
                "mean_open_sessions": [round(h["mean_open_sessions"], 2) for h in r["hubs"]],
                "jobs": [h["jobs"] for h in r["hubs"]],
                "busy_fraction": [round(h["busy_fraction"], 3) for h in r["hubs"]],
            }
        )
    worst = [r["balance"]["sessions_placed"]["max_over_even"] for r in two]
    worst_jobs = [r["balance"]["jobs"]["max_over_even"] for r in two]
    return {
        "per_n": per_n,
        "worst_sessions_max_over_even": max((w for w in worst if w), default=None),
        "worst_jobs_max_over_even": max((w for w in worst_jobs if w), default=None),
    }


def sweep_summary(runs: list[dict]) -> dict[str, Any]:
    """Saturated throughput per mode (median over repeats, best N), the ratio two/one against
    the 1.8x target (and the static split's, the control), the paired ratios per N, the
    balance and the emulator's CPU share."""
    present = [m for m in MODES if any(r["mode"] == m for r in runs)]
    sat = {mode: saturated(median_by(runs, mode)) for mode in present}
    ratio = sat[TWO][1] / sat[ONE][1]
    return {
        "saturated_tokens_per_s": {m: v for m, (_, v) in sat.items()},
        "saturated_at_n": {m: n for m, (n, _) in sat.items()},
        "saturated_ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "saturated_ratio_static": sat[SPLIT][1] / sat[ONE][1] if SPLIT in sat else None,
        "ratio_by_n": paired_ratios(runs),
        "ratio_by_n_static": paired_ratios(runs, SPLIT),
        "busy_by_n": {m: median_by(runs, m, "hub_busy_fraction") for m in present},
        "emulator_cpu_by_n": {m: median_by(runs, m, "emulator_cpu_fraction") for m in present},
        "balance": balance_summary(runs),
    }


# ---------------------------------------------------------------------- the fault run


def fault_summary(
    rows: list[list[dict]],
    reference: list[dict],
    heartbeat_s: float,
    detection_s: list[float | None],
) -> dict[str, Any]:
    """Outputs against the target alone, and the moved sequences' resume times against one
    heartbeat: median and max of ``resume_s``, and standalone steps after a move."""
    expected = {r["prompt"]: r["token_ids"] for r in reference}
    flat = [r for target in rows for r in target]
    mismatched = [r["prompt"] for r in flat if r["token_ids"] != expected.get(r["prompt"])]
    moved = [r["stats"] for r in flat if r["stats"]["moves"]]
    resume = sorted(s["resume_s"] for s in moved)
    return {
        "sequences": len(flat),
        "identical_to_target_alone": not mismatched,
        "mismatched_prompts": mismatched,
        "moved_sequences": len(moved),
        "resume_s_median": statistics.median(resume) if resume else None,
        "resume_s_max": resume[-1] if resume else None,
        "resume_s": resume,
        "heartbeat_s": heartbeat_s,
        "resumed_within_one_heartbeat": bool(resume) and resume[-1] <= heartbeat_s,
        "standalone_after_move": sum(s["standalone_after_move"] for s in moved),
        "detection_s": detection_s,
    }


# ---------------------------------------------------------------------- report


def markdown(result: dict) -> str:
    """The sweep per N side by side, and the summary lines."""
    sweep, fault = result["sweep"], result["fault"]
    one, two, split = (median_by(result["runs"], m) for m in MODES)
    busy, emu = sweep["busy_by_n"], sweep["emulator_cpu_by_n"]
    lines = [
        "| N | one hub tok/s | two hubs tok/s | two/one | static split tok/s | static/one "
        "| busy one / two / static | emulator CPU two |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in one:
        lines.append(
            f"| {n} | {one[n]:.0f} | {two.get(n, 0):.0f} | "
            f"{sweep['ratio_by_n'].get(str(n), 0):.2f} | {split.get(n, 0):.0f} | "
            f"{sweep['ratio_by_n_static'].get(str(n), 0):.2f} | {busy[ONE][n]:.2f} / "
            f"{busy[TWO].get(n, 0):.2f} / {busy.get(SPLIT, {}).get(n, 0):.2f} | "
            f"{emu[TWO].get(n, 0):.2f} |"
        )
    sat = sweep["saturated_tokens_per_s"]
    lines += [
        "",
        f"* saturated: one hub {sat[ONE]:.0f} tok/s, two hubs {sat[TWO]:.0f} tok/s: "
        f"{sweep['saturated_ratio']:.2f}x (target {TARGET_RATIO}x); static split "
        f"{sweep['saturated_ratio_static'] or 0:.2f}x",
        f"* balance (sessions placed per hub, busy per hub): "
        f"{json.dumps(sweep['balance']['per_n'])}",
        f"* fault: {fault['sequences']} sequences, identical to the target alone: "
        f"{fault['identical_to_target_alone']}; {fault['moved_sequences']} moved, "
        f"resume_s median {fault['resume_s_median']} max {fault['resume_s_max']} "
        f"(heartbeat {fault['heartbeat_s']} s); standalone steps after a move: "
        f"{fault['standalone_after_move']}; detection after the kill (s): "
        f"{fault['detection_s']}",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Throughput vs N per mode (and the ratio), sessions per hub, the resume times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_b, ax_r) = plt.subplots(1, 3, figsize=(17, 4.6))
    for mode, c in ((ONE, "C0"), (TWO, "C1"), (SPLIT, "C2")):
        runs = [r for r in result["runs"] if r["mode"] == mode]
        ax.scatter(
            [r["n_targets"] for r in runs],
            [r["system_tokens_per_s"] for r in runs],
            c=c,
            s=12,
            alpha=0.5,
        )
        med = median_by(result["runs"], mode)
        ax.plot(list(med), list(med.values()), "o-", c=c, label=f"{mode} (median)")
    ax.set(
        xscale="log",
        xlabel="emulated targets N",
        ylabel="system tokens/s",
        title=f"saturated two/one: {result['sweep']['saturated_ratio']:.2f}x",
    )
    ax.legend(fontsize=8)
    _plot_balance(result, ax_b)
    _plot_resume(result["fault"], ax_r)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_balance(result: dict, ax: Any) -> None:
    per_n = result["sweep"]["balance"]["per_n"]
    ns = list(per_n)
    for hub in range(2):
        shares = [
            statistics.median(
                p["sessions_placed"][hub] / max(sum(p["sessions_placed"]), 1) for p in per_n[n]
            )
            for n in ns
        ]
        busy = [statistics.median(p["busy_fraction"][hub] for p in per_n[n]) for n in ns]
        ax.plot(ns, shares, "s-", label=f"hub {'AB'[hub]}: share of sessions placed")
        ax.plot(ns, busy, "^--", label=f"hub {'AB'[hub]}: busy fraction")
    ax.axhline(0.5, c="grey", lw=0.8)
    ax.set(xlabel="emulated targets N", ylim=(0, 1.05), title="two hubs: balance")
    ax.legend(fontsize=8)


def _plot_resume(fault: dict, ax: Any) -> None:
    resume = fault["resume_s"]
    ax.plot(range(len(resume)), resume, "o", label="resume_s per moved sequence")
    ax.axhline(fault["heartbeat_s"], c="red", ls="--", label="one heartbeat")
    ax.set(
        xlabel="moved sequences (sorted)",
        ylabel="s",
        title=f"fault: detection -> speculating again; identical outputs: "
        f"{fault['identical_to_target_alone']}",
    )
    ax.legend(fontsize=8)
