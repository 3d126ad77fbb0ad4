"""The analytic model of one draft hub serving N targets.

    python -m starsd.analytic --alpha 0.7 --gamma 4 --draft-ms 3.2 --verify-ms 4.5 \
        --link-ms 0.3 --target-step-ms 3.5 --n 1 2 4 8 16 [--plot curves.png]
    python -m starsd.analytic --from results/bench.json [--plot curves.png]

Terms (times per round of one target):
  E[L]   expected tokens a round commits: (1 - alpha^(gamma+1)) / (1 - alpha) for i.i.d.
         acceptance with rate alpha (gamma + 1 when alpha = 1);
  S(d)   the hub's draft service time for one proposal of gamma tokens;
  R      what happens outside the hub: the target's verify forward plus the link round trip;
  T_ar   the target's own autoregressive step (the standalone baseline: 1 / T_ar tokens/s).

With N targets and a hub that drafts one proposal at a time, the hub's iteration (one proposal
for every target) takes T_gamma = N * S(d) + T_idle, where T_idle = max(0, S(d) + R - N * S(d))
is the time the hub waits for verdicts. Under-loaded (T_idle > 0): every target gets a round
every S(d) + R, so system throughput grows linearly with N. Fully loaded (T_idle = 0, from
N_full = ceil((S(d) + R) / S(d)) on): the hub is the bottleneck, system throughput stays at
E[L] / S(d) and more targets only queue. Per-target throughput E[L] / T_gamma falls below the
standalone 1 / T_ar once N > E[L] * T_ar / S(d).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelInputs:
    """Measured (or assumed) inputs of the model; times in seconds."""

    alpha: float  # per-token acceptance rate
    gamma: int
    draft_s: float  # S(d): hub time to draft one proposal
    verify_s: float  # target verify forward of gamma + 1 positions
    link_s: float  # network round trip + (de)serialisation per round
    target_step_s: float  # T_ar: the target's standalone decode step


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


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[L]: tokens committed per round (accepted drafts + the target's own token)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


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


def saturation_point(inputs: ModelInputs) -> int:
    """N_full: the fewest targets that keep the hub drafting all the time."""
    return max(1, math.ceil((inputs.draft_s + round_trip_outside_hub(inputs)) / inputs.draft_s))


def predict(inputs: ModelInputs, n_targets: int) -> Prediction:
    """Throughput and regime for ``n_targets`` targets."""
    cycle = inputs.draft_s + round_trip_outside_hub(inputs)  # one target alone: S + R
    busy = n_targets * inputs.draft_s
    idle = max(0.0, cycle - busy)
    iteration = busy + idle  # T_gamma
    tokens = expected_tokens_per_round(inputs.alpha, inputs.gamma)
    return Prediction(
        n_targets=n_targets,
        regime="under-loaded" if idle > 0 else "fully-loaded",
        iteration_s=iteration,
        idle_s=idle,
        system_tokens_per_s=n_targets * tokens / iteration,
        per_target_tokens_per_s=tokens / iteration,
        hub_busy_fraction=busy / iteration,
    )


def break_even_targets(inputs: ModelInputs) -> int:
    """Largest N at which each target is still at least as fast as standalone."""
    tokens = expected_tokens_per_round(inputs.alpha, inputs.gamma)
    by_hub = math.floor(tokens * inputs.target_step_s / inputs.draft_s)
    alone_faster = tokens / (inputs.draft_s + round_trip_outside_hub(inputs))
    if alone_faster < 1.0 / inputs.target_step_s:
        return 0  # even one target is slower than standalone
    return max(by_hub, 1)


def table(inputs: ModelInputs, ns: list[int]) -> str:
    """A markdown table of predictions against N, with the regime boundaries."""
    standalone = 1.0 / inputs.target_step_s
    lines = [
        f"E[L] = {expected_tokens_per_round(inputs.alpha, inputs.gamma):.3f} tokens/round, "
        f"N_full = {saturation_point(inputs)}, break-even N = {break_even_targets(inputs)}, "
        f"standalone = {standalone:.1f} tok/s per target",
        "",
        "| N | regime | T_gamma ms | T_idle ms | system tok/s | per-target tok/s | hub busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in ns:
        p = predict(inputs, n)
        lines.append(
            f"| {n} | {p.regime} | {1e3 * p.iteration_s:.2f} | {1e3 * p.idle_s:.2f} | "
            f"{p.system_tokens_per_s:.1f} | {p.per_target_tokens_per_s:.1f} | "
            f"{p.hub_busy_fraction:.2f} |"
        )
    return "\n".join(lines)


def plot(inputs: ModelInputs, ns: list[int], path: str) -> None:
    """System and per-target throughput curves against N (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = list(range(1, max(ns) + 1))
    preds = [predict(inputs, n) for n in grid]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(grid, [p.system_tokens_per_s for p in preds], label="system (predicted)")
    ax.plot(grid, [p.per_target_tokens_per_s for p in preds], label="per target (predicted)")
    ax.axhline(1.0 / inputs.target_step_s, ls=":", c="grey", label="standalone per target")
    ax.axvline(saturation_point(inputs), ls="--", c="red", label="N_full")
    ax.set(xlabel="targets N", ylabel="tokens/s", xscale="log", title="StarSD analytic model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def inputs_from_bench(path: str | Path) -> ModelInputs:
    """Model inputs recorded by scripts/bench.py (its ``model_inputs`` object)."""
    raw = json.loads(Path(path).read_text())["model_inputs"]
    return ModelInputs(**raw)


def parse_args(argv: list[str] | None = None) -> tuple[ModelInputs, list[int], str | None]:
    """argparse -> (inputs, N values, plot path)."""
    p = argparse.ArgumentParser(prog="python -m starsd.analytic",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--from", dest="source", help="a benchmark JSON with model_inputs")
    p.add_argument("--alpha", type=float, default=0.7)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--draft-ms", type=float, default=3.0, help="S(d) per proposal")
    p.add_argument("--verify-ms", type=float, default=5.0)
    p.add_argument("--link-ms", type=float, default=0.3)
    p.add_argument("--target-step-ms", type=float, default=4.0)
    p.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--plot", help="write the curves to this PNG")
    a = p.parse_args(argv)
    if a.source:
        inputs = inputs_from_bench(a.source)
    else:
        inputs = ModelInputs(a.alpha, a.gamma, a.draft_ms / 1e3, a.verify_ms / 1e3,
                             a.link_ms / 1e3, a.target_step_ms / 1e3)  # fmt: skip
    return inputs, a.n, a.plot


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m starsd.analytic``."""
    inputs, ns, plot_path = parse_args(argv)
    print(table(inputs, ns))
    if plot_path:
        plot(inputs, ns, plot_path)
        print(f"plot: {plot_path}")


if __name__ == "__main__":
    main()
