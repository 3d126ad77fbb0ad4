"""The analytic model's command line: its tables and plots.

    python -m starsd.analytic --alpha 0.7 --gamma 4 --draft-ms 3.2 --verify-ms 4.5 \
        --link-ms 0.3 --target-step-ms 3.5 --n 1 2 4 8 16 [--plot curves.png]
    python -m starsd.analytic --max-batch 64 --curve 1:4.3,8:4.7,32:6.5 --n 64 256 1024
    python -m starsd.analytic --from results/bench.json [--plot curves.png]
    python -m starsd.analytic --gamma auto --alpha 0.7 ... --n 1 8 64    # the gamma auto picks
    python -m starsd.analytic --verify-per-token-ms 9.5 ...   # a verify that grows with gamma
    python -m starsd.analytic --hit-rate 0.4 ...      # pre-drafting answers 40% while idle
    python -m starsd.analytic --hit-rate 0.5 --taken-rate 0.35 ...  # 35% taken as pushed
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from starsd.analytic import (
    ModelInputs,
    auto_gamma,
    break_even_targets,
    expected_tokens_per_round,
    inputs_from_bench,
    predict,
    saturation_point,
    service_s,
)
from starsd.service import ServiceCurve

# ---------------------------------------------------------------------------------- tables


def _verify_words(inputs: ModelInputs) -> str:
    if not inputs.verify_per_token_s:
        return "R constant"
    return f"verify {1e3 * inputs.verify_per_token_s:.3f} ms more per draft token"


def auto_table(inputs: ModelInputs, ns: list[int], max_gamma: int = 16) -> str:
    """A markdown table of the gamma auto settles at against N, beside the inputs' fixed one."""
    lines = [
        f"auto gamma (0..{max_gamma}; S measured at gamma {inputs.gamma}, scaled per draft "
        f"step; {_verify_words(inputs)}; T_alone = T_ar = {1e3 * inputs.target_step_s:.2f} ms):",
        "",
        "| N | gamma | regime | system tok/s | per-target tok/s | hub busy "
        f"| system tok/s at gamma {inputs.gamma} |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in ns:
        gamma, p = auto_gamma(inputs, n, max_gamma)
        fixed = predict(inputs, n)
        lines.append(
            f"| {n} | {gamma} | {p.regime} | {p.system_tokens_per_s:.1f} | "
            f"{p.per_target_tokens_per_s:.1f} | {p.hub_busy_fraction:.2f} | "
            f"{fixed.system_tokens_per_s:.1f} |"
        )
    return "\n".join(lines)


def curve_sizes(inputs: ModelInputs) -> list[int]:
    """The batch sizes worth showing: 1, the measured ones up to M, and M."""
    measured = list(inputs.curve.sizes) if inputs.curve is not None else []
    return sorted({1, inputs.max_batch, *(b for b in measured if b <= inputs.max_batch)})


def curve_table(inputs: ModelInputs) -> str:
    """S(B) as a markdown table: B, S(B) ms, S(B) / S(1), proposals/s = B / S(B)."""
    one = service_s(inputs, 1)
    source = "measured curve" if inputs.curve is not None else "one at a time"
    lines = [
        f"S(B), max batch M = {inputs.max_batch} ({source}):",
        "",
        "| B | S(B) ms | S(B)/S(1) | proposals/s |",
        "|---|---|---|---|",
    ]
    for b in curve_sizes(inputs):
        s = service_s(inputs, b)
        lines.append(f"| {b} | {1e3 * s:.2f} | {s / one:.2f} | {b / s:.0f} |")
    return "\n".join(lines)


def table(inputs: ModelInputs, ns: list[int]) -> str:
    """A markdown table of predictions against N, with the regime boundaries."""
    standalone = 1.0 / inputs.target_step_s
    lines = [
        f"E[L] = {expected_tokens_per_round(inputs.alpha, inputs.gamma):.3f} tokens/round, "
        f"N_full = {saturation_point(inputs)}, break-even N = {break_even_targets(inputs)}, "
        f"standalone = {standalone:.1f} tok/s per target",
        "",
        "| N | regime | T_gamma ms | T_idle ms | system tok/s | per-target tok/s | hub busy "
        "| k x B_1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in ns:
        p = predict(inputs, n)
        lines.append(
            f"| {n} | {p.regime} | {1e3 * p.iteration_s:.2f} | {1e3 * p.idle_s:.2f} | "
            f"{p.system_tokens_per_s:.1f} | {p.per_target_tokens_per_s:.1f} | "
            f"{p.hub_busy_fraction:.2f} | {p.batches} x {p.largest_batch} |"
        )
    return "\n".join(lines)


def plot(inputs: ModelInputs, ns: list[int], path: str) -> None:
    """Throughput against N, and S(B) against B, side by side (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    _plot_throughput(left, inputs, ns)
    _plot_curve(right, inputs)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_throughput(ax: Any, inputs: ModelInputs, ns: Sequence[int]) -> None:
    grid = list(range(1, max(ns) + 1))
    preds = [predict(inputs, n) for n in grid]
    ax.plot(grid, [p.system_tokens_per_s for p in preds], label="system (predicted)")
    ax.plot(grid, [p.per_target_tokens_per_s for p in preds], label="per target (predicted)")
    ax.axhline(1.0 / inputs.target_step_s, ls=":", c="grey", label="standalone per target")
    ax.axvline(saturation_point(inputs), ls="--", c="red", label="N_full")
    ax.set(xlabel="targets N", ylabel="tokens/s", xscale="log", title="StarSD analytic model")
    ax.legend()


def _plot_curve(ax: Any, inputs: ModelInputs) -> None:
    grid = list(range(1, inputs.max_batch + 1))
    ax.plot(grid, [1e3 * service_s(inputs, b) for b in grid], label="S(B) (model)")
    if inputs.curve is not None:
        sizes, times = zip(*inputs.curve.table(inputs.gamma), strict=True)
        ax.plot(sizes, [1e3 * s for s in times], "o", label="measured")
    ax.set(xlabel="batch size B", ylabel="ms per batch", title=f"S(B), M = {inputs.max_batch}")
    ax.set_ylim(bottom=0)
    ax.legend()


# ---------------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> tuple[ModelInputs, list[int], str | None]:
    """argparse -> (inputs, N values, plot path); see :func:`parse_cli` for --gamma auto."""
    inputs, ns, plot_path, _ = parse_cli(argv)
    return inputs, ns, plot_path


def parse_cli(
    argv: list[str] | None = None,
) -> tuple[ModelInputs, list[int], str | None, int | None]:
    """argparse -> (inputs, N values, plot path, max gamma under --gamma auto, else None)."""
    p = argparse.ArgumentParser(
        prog="python -m starsd.analytic", description=__doc__.split("\n")[0]
    )
    p.add_argument("--from", dest="source", help="a benchmark JSON with model_inputs")
    p.add_argument("--alpha", type=float, default=0.7)
    p.add_argument(
        "--gamma",
        default="4",
        help="draft tokens per round, or auto: the gamma the hub's policy settles "
        "at per N (S and verify are then taken as measured at gamma 4, or the "
        "benchmark's gamma)",
    )
    p.add_argument("--max-gamma", type=int, default=16, help="auto: the largest gamma")
    p.add_argument("--draft-ms", type=float, default=3.0, help="S(d) = S(1) per proposal")
    p.add_argument("--verify-ms", type=float, default=5.0)
    p.add_argument(
        "--verify-per-token-ms",
        type=float,
        default=0.0,
        help="how much the verify grows per draft token (0: R constant in gamma)",
    )
    p.add_argument("--link-ms", type=float, default=0.3)
    p.add_argument("--target-step-ms", type=float, default=4.0)
    p.add_argument("--max-batch", type=int, help="M (default: the curve's largest B, else 1)")
    p.add_argument("--curve", help="S(B) as B:ms pairs, e.g. 1:4.3,8:4.7,32:6.5")
    p.add_argument(
        "--hit-rate",
        type=float,
        default=0.0,
        help="share of jobs answered from pre-drafted branches while the hub idles",
    )
    p.add_argument(
        "--taken-rate",
        type=float,
        default=0.0,
        help="of which the target took the branch pushed to it (<= --hit-rate)",
    )
    p.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--plot", help="write the curves to this PNG")
    a = p.parse_args(argv)
    auto = a.gamma == "auto"
    try:
        a.gamma = 4 if auto else int(a.gamma)
        if a.gamma < 1 or a.max_gamma < 1:
            raise ValueError("--gamma and --max-gamma must be >= 1 (or --gamma auto)")
        inputs = _with_batching(_base_inputs(a), a.curve, a.max_batch)
        inputs = dataclasses.replace(inputs, hit_rate=a.hit_rate, taken_rate=a.taken_rate)
        if a.verify_per_token_ms:
            inputs = dataclasses.replace(inputs, verify_per_token_s=a.verify_per_token_ms / 1e3)
    except ValueError as exc:
        p.error(str(exc))
    return inputs, a.n, a.plot, a.max_gamma if auto else None


def _base_inputs(a: argparse.Namespace) -> ModelInputs:
    if a.source:
        return inputs_from_bench(a.source)
    return ModelInputs(
        a.alpha,
        a.gamma,
        a.draft_ms / 1e3,
        a.verify_ms / 1e3,
        a.link_ms / 1e3,
        a.target_step_ms / 1e3,
    )


def _with_batching(inputs: ModelInputs, curve: str | None, max_batch: int | None) -> ModelInputs:
    """``--curve`` and ``--max-batch`` over the base inputs (flags, or a benchmark's)."""
    if curve is not None:
        parsed = ServiceCurve.parse(curve, inputs.gamma)
        batch = max_batch if max_batch is not None else parsed.sizes[-1]
        return dataclasses.replace(
            inputs, draft_s=parsed.at(1, inputs.gamma), max_batch=batch, curve=parsed
        )
    if max_batch is not None:
        return dataclasses.replace(inputs, max_batch=max_batch)
    return inputs


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m starsd.analytic``."""
    inputs, ns, plot_path, max_gamma = parse_cli(argv)
    print(curve_table(inputs))
    print()
    print(table(inputs, ns))
    if max_gamma is not None:
        print()
        print(auto_table(inputs, ns, max_gamma))
    if plot_path:
        plot(inputs, ns, plot_path)
        print(f"plot: {plot_path}")
