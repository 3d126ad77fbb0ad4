"""The main and lan suites' report: a markdown table of the runs and the plot."""

from __future__ import annotations

from pathlib import Path

from scripts.bench import assisted as bench_assisted
from scripts.bench import predraft as bench_predraft
from scripts.bench import scale_report


def markdown(result: dict) -> str:
    """The runs as a short markdown table, then the paired and pre-drafting comparisons."""
    lines = [
        runs_table(result),
        *bench_assisted.markdown(result.get("vs_hf_assisted")),
        *bench_predraft.markdown(result.get("predraft")),
    ]
    return "\n".join(lines)


def runs_table(result: dict) -> str:
    """The runs as a short markdown table."""
    lines = [
        "| mode | N | system tok/s | predicted | per-target tok/s | hub busy | "
        "mean accepted | latency mean/p99/std ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lat = r["latency_ms"] or {}
        lines.append(
            f"| {label(r)} | {r['n_targets']} | {r['system_tokens_per_s']:.1f} | "
            f"{_fmt(r['predicted_system_tokens_per_s'])} | {r['per_target_tokens_per_s']:.1f} | "
            f"{_fmt(r['hub_busy_fraction'], 2)} | {_fmt(r['mean_accepted'], 2)} | "
            f"{lat.get('mean', 0):.2f}/{lat.get('p99', 0):.2f}/{lat.get('std', 0):.2f} |"
        )
    return "\n".join(lines)


def label(record: dict) -> str:
    """A run's mode, with its drafter when that is not a draft LLM."""
    kind = record.get("draft_kind")
    return f"{record['mode']} ({kind})" if kind and kind != "llm" else record["mode"]


def _fmt(value: float | None, digits: int = 1) -> str:
    """A number, or a dash where there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def plot(result: dict, path: Path, concurrency: int) -> None:
    """Measured against predicted system throughput per run; for the main suite also the
    batched hub against the one-at-a-time hub per N (each target at ``concurrency``)."""
    if result["suite"] == "scale":
        scale_report.plot(result, path)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    pairs = result.get("batched_vs_one_at_a_time") or {}
    fig, axes = plt.subplots(
        1,
        2 if pairs else 1,
        figsize=(13 if pairs else 8, 4.8),
        gridspec_kw={"width_ratios": [2.2, 1]} if pairs else None,
        squeeze=False,
    )
    ax = axes[0][0]
    labels = [f"{label(r)}\nN={r['n_targets']}" for r in runs]
    ax.bar(labels, [r["system_tokens_per_s"] for r in runs], label="measured")
    modelled = [
        (lab, r["predicted_system_tokens_per_s"])
        for lab, r in zip(labels, runs, strict=True)
        if r["predicted_system_tokens_per_s"] is not None
    ]
    ax.scatter(
        [lab for lab, _ in modelled], [p for _, p in modelled], c="red", zorder=3, label="model"
    )
    ax.set(ylabel="system tokens/s")
    ax.tick_params(axis="x", labelsize=6, labelrotation=90)
    ax.legend()
    ax.set_title(f"StarSD {result['suite']} benchmark")
    if pairs:
        ax2 = axes[0][1]
        ns = sorted(pairs, key=int)
        width = 0.38
        xs = range(len(ns))
        for offset, key, legend in (
            (-width / 2, "one_at_a_time", "--max-batch 1"),
            (width / 2, "batched", "batched"),
        ):
            ax2.bar(
                [x + offset for x in xs], [pairs[n].get(key, 0) for n in ns], width, label=legend
            )
        ax2.set_xticks(list(xs), [f"N={n} x {concurrency}" for n in ns])
        ax2.set(ylabel="system tokens/s", title="one hub: batched vs one at a time")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
