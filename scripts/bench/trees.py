"""The scale suite's tree part: token trees under ``--tree auto`` against chains only, with
emulated targets against the real hub (run by ``scripts/bench/scale.py``).

At each N three modes, back to back in a rotating order and then mirrored (as the gamma
comparison, :mod:`scripts.bench.gamma`: this machine's speed drifts), every session under
``--gamma auto``:

* ``chains``: the emulated targets announce no trees (HELLO ``tree_nodes`` 0), so the hub
  drafts chains only: what ``--tree off`` does;
* ``auto``: the same hub (``--tree auto``), the targets announcing trees: the policy picks
  tree or chain (:mod:`starsd.hub.shapes`);
* ``on``: a hub under ``--tree on``: a tree every round.

An emulated target verifies a tree in the verify time of its node count (a target profile's
V(1, nodes), or ``auto_verify_ms`` + ``auto_verify_per_token_ms`` per node) and draws its
accepted path as :mod:`scripts.emulate.acceptance` says; the emulated drafter costs a tree as
the real ones draft it (:mod:`starsd.hub.drafters.emulated`). Target: ``auto`` at least 0.95x
``chains`` at every N (trees must not cost throughput, at saturation least of all).

The model beside them (:mod:`starsd.analytic`): chains at the gamma auto picks, as in the
gamma comparison; trees with the tree's E[L] (:func:`starsd.analytic.expected_tree_tokens`
of the tree the hub grows) and its service time, the verify time measured in the ``on`` runs;
auto the better of the two, chains once the hub is fully loaded (the policy's rule).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from scripts.bench import gamma as bench_gamma
from scripts.bench.common import BenchConfig, run_record
from scripts.emulate.acceptance import SIBLING_ALPHA
from starsd import analytic, limits
from starsd.hub.config import HubConfig
from starsd.tree_shapes import TreeShape, ranked_tree

CHAINS, AUTO, ON = "chains", "auto", "on"
MODES = (CHAINS, AUTO, ON)
TARGET_RATIO = 0.95  # auto against chains only, at every N


def mode_name(mode: str) -> str:
    """A record's mode for one tree mode."""
    return f"trees-{mode}"


def hub_shape() -> TreeShape:
    """The tree the suite's hubs grow (their default --tree-width/-depth/-nodes)."""
    config = HubConfig(model="")
    return TreeShape(config.tree_width, config.tree_depth, config.tree_budget)


def emulator_args(mode: str) -> list[str]:
    """Emulator options for ``mode``: whether its targets announce trees (and how many nodes
    they take: the most the protocol allows, so the hub's budget decides)."""
    nodes = 0 if mode == CHAINS else limits.MAX_TREE_NODES
    return ["--tree-nodes", str(nodes), "--gamma", "0"]


def run_comparison(
    cfg: BenchConfig, auto: bench_gamma.Emulate, on: bench_gamma.Emulate
) -> dict[str, list[dict]]:
    """Every (N, mode), order rotating and mirrored: chains and auto through ``auto`` (the
    --tree auto hub), on through ``on``; merged reports by mode name."""
    ns = bench_gamma.QUICK_GAMMA_NS if cfg.quick else bench_gamma.GAMMA_NS
    timing = (
        [
            "--duration",
            str(bench_gamma.QUICK_DURATION_S),
            "--calibration",
            str(bench_gamma.QUICK_CALIBRATION_S),
        ]
        if cfg.quick
        else []
    )
    runs: dict[tuple[str, int], list[dict]] = {}
    for n, mode in bench_gamma.gamma_order(ns, MODES, repeats=bench_gamma.REPEATS):
        run = on if mode == ON else auto
        args = [*bench_gamma.target_args(cfg), *emulator_args(str(mode)), *timing]
        report = run(n, f"-{mode_name(str(mode))}", args)
        runs.setdefault((mode_name(str(mode)), n), []).append(report)
        print(
            f"[trees] {mode_name(str(mode))}, {n} emulated targets: "
            f"{report['system_tokens_per_s']:.0f} tok/s, trees {report['tree_fraction']:.2f} of "
            f"rounds, busy {report['hub_busy_fraction']:.2f}",
            flush=True,
        )
    reports: dict[str, list[dict]] = {mode_name(m): [] for m in MODES}
    for (name, _), same in runs.items():
        reports[name].append(bench_gamma.merge_reports(same))
    return reports


# ---------------------------------------------------------------------- the model


def tree_inputs(
    inputs: analytic.ModelInputs, reports: dict[str, list[dict]], shape: TreeShape
) -> analytic.ModelInputs:
    """``inputs`` with a tree every round: the hub's tree, its E[L] under the emulation's
    acceptance, its verify time as measured in the ``on`` runs."""
    _, parents = ranked_tree(shape)
    tokens = analytic.expected_tree_tokens(inputs.alpha, SIBLING_ALPHA, parents)
    verify = [r["verify_ms"] for r in reports.get(mode_name(ON), []) if r.get("verify_ms")]
    return replace(
        inputs,
        tree=analytic.TreeRound(shape.width, shape.depth, tokens),
        verify_s=statistics.median(verify) / 1e3 if verify else inputs.verify_s,
    )


def model_at(chains: analytic.ModelInputs, trees: analytic.ModelInputs, n: int) -> dict[str, Any]:
    """Each mode's predicted system tokens/s at ``n`` targets, and what auto would pick."""
    chain = bench_gamma.model_at(chains, n)
    tree = analytic.predict(trees, n)
    pick_tree = analytic.pick_shape(analytic.auto_gamma(chains, n)[1], [tree]) == 1
    rates = {CHAINS: chain["auto_tokens_per_s"], ON: tree.system_tokens_per_s}
    rates[AUTO] = rates[ON] if pick_tree else rates[CHAINS]
    return {"tokens_per_s": rates, "auto_picks_trees": pick_tree, "tree_regime": tree.regime}


# ---------------------------------------------------------------------- summaries


def records(
    reports: dict[str, list[dict]],
    chains: analytic.ModelInputs | None,
    trees: analytic.ModelInputs | None,
) -> list[dict]:
    """One ``runs`` record per (mode, N), the model's prediction for that mode beside it."""
    out = []
    for mode in MODES:
        for r in reports.get(mode_name(mode), []):
            n = r["n_targets"]
            predicted = None
            if chains is not None and trees is not None:
                predicted = model_at(chains, trees, n)["tokens_per_s"][mode]
            out.append(
                run_record(
                    mode_name(mode),
                    n,
                    system_tokens_per_s=r["system_tokens_per_s"],
                    per_target_tokens_per_s=r["per_target_tokens_per_s"],
                    predicted_system_tokens_per_s=predicted,
                    hub_busy_fraction=r["hub_busy_fraction"],
                    tree_fraction=r["tree_fraction"],
                    tokens_per_tree_round=r["tokens_per_tree_round"],
                    mean_gamma=r["mean_gamma"],
                    mean_batch_size=r.get("mean_batch_size"),
                    verify_ms=r["verify_ms"],
                    latency_ms=r["latency_ms"],
                )
            )
    return out


def compare(
    reports: dict[str, list[dict]],
    chains: analytic.ModelInputs | None,
    trees: analytic.ModelInputs | None,
) -> dict:
    """Per N: each mode's throughput, auto over chains, auto's share of tree rounds, the
    model's view; and whether auto kept TARGET_RATIO of chains everywhere."""
    by_n: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        for r in reports.get(mode_name(mode), []):
            row = by_n.setdefault(str(r["n_targets"]), {"tokens_per_s": {}, "tree_fraction": {}})
            row["tokens_per_s"][mode] = r["system_tokens_per_s"]
            row["tree_fraction"][mode] = r["tree_fraction"]
            row.setdefault("runs_tokens_per_s", {})[mode] = r.get("runs_tokens_per_s")
    for n, row in by_n.items():
        rates = row["tokens_per_s"]
        if CHAINS in rates and AUTO in rates:
            row["auto_over_chains"] = rates[AUTO] / rates[CHAINS]
            row["ok"] = row["auto_over_chains"] >= TARGET_RATIO
        if CHAINS in rates and ON in rates:
            row["on_over_chains"] = rates[ON] / rates[CHAINS]
        if chains is not None and trees is not None:
            row["model"] = model_at(chains, trees, int(n))
    ratios = [row["auto_over_chains"] for row in by_n.values() if "auto_over_chains" in row]
    return {
        "by_n": dict(sorted(by_n.items(), key=lambda kv: int(kv[0]))),
        "target_ratio": TARGET_RATIO,
        "min_auto_over_chains": min(ratios, default=None),
        "all_ok": bool(ratios) and min(ratios) >= TARGET_RATIO,
        "sibling_alpha": SIBLING_ALPHA,
    }


def markdown(trees: dict | None) -> list[str]:
    """The comparison's table, as markdown lines."""
    if not trees:
        return []
    lines = [
        "",
        "| N | chains tok/s | auto tok/s | on tok/s | auto / chains | auto: tree rounds | "
        "model: chains / auto / on |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, row in trees["by_n"].items():
        rates, model = row["tokens_per_s"], (row.get("model") or {}).get("tokens_per_s", {})
        cells = " | ".join(f"{rates[m]:.0f}" if m in rates else "-" for m in MODES)
        modelled = " / ".join(f"{model[m]:.0f}" if m in model else "-" for m in MODES)
        lines.append(
            f"| {n} | {cells} | {row.get('auto_over_chains', 0):.3f} | "
            f"{row['tree_fraction'].get(AUTO, 0):.2f} | {modelled} |"
        )
    lines.append(
        f"* --tree auto / chains only: least {trees['min_auto_over_chains'] or 0:.3f} "
        f"(target >= {trees['target_ratio']}): {'met' if trees['all_ok'] else 'missed'}"
    )
    return lines


def plot(trees: dict, ax: Any) -> None:
    """System tokens/s against N for each tree mode; the model's auto dashed."""
    ns = sorted(trees["by_n"], key=int)
    xs = [int(n) for n in ns]
    for mode in MODES:
        ys = [trees["by_n"][n]["tokens_per_s"].get(mode) for n in ns]
        ax.plot(xs, ys, "o-" if mode == AUTO else ".-", lw=2.5 if mode == AUTO else 1, label=mode)
    modelled = [(trees["by_n"][n].get("model") or {}).get("tokens_per_s", {}) for n in ns]
    if all(m for m in modelled):
        ax.plot(xs, [m[AUTO] for m in modelled], "k--", lw=1, label="model: auto")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="emulated targets N",
        ylabel="system tokens/s",
        title="token trees: --tree auto vs chains only vs on",
    )
    ax.legend(fontsize=8)
