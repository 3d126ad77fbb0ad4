"""S(B): the hub's own proposers timed on B sessions at once (draft LLM and EAGLE head).

    python -m scripts.bench.service [--quick] [--out results/bench-service.json]

Loads each drafter exactly as ``python -m starsd.hub`` does (``starsd.hub.build.load_proposer``,
one torch thread) and times ``proposer.propose(jobs)``: the whole proposal (gamma = 4, greedy)
for B fake sessions at once, B = 1, 2, 4, ..., 64, the sizes alternating across repeats so this
machine's drifting speed hits every size alike. Each session starts from a 64-token prompt and
gets realistic verdicts (2 drafts accepted and one token appended per round, so its context
grows as a real one does); EAGLE jobs carry random target features of the right shape. Reports
the median S(B) and S(B) / S(1) (a proposer that loops over jobs shows S(B) ~ B * S(1); a batched
forward stays far below), and the RSS that 100 sessions holding 512 tokens of context add.

Also run by the scale suite (``make bench-scale``), on the CPU the hubs draft on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench.harness import REPO, rss_mb
from starsd.hub.synthetic import ACCEPTED, FakeSessions

SIZES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_TOKENS = 64
RSS_SESSIONS = 100
RSS_CONTEXT = 512
# The targets for the whole proposal of the default draft LLM.
TARGET_RATIOS = {8: 1.5, 32: 2.5}


def time_sizes(
    sessions: FakeSessions, sizes: tuple[int, ...], repeats: int
) -> dict[int, list[float]]:
    """Seconds per ``propose`` call for each batch size, sizes alternating across repeats.

    Each size has its own sessions (prefilled, then one untimed round), so every timed round
    of a size sees the same context lengths whatever the order.
    """
    pools = {b: sessions.open(b, PROMPT_TOKENS) for b in sizes}
    for pool in pools.values():
        sessions.propose(pool)  # untimed: the first DRAFT after the prefill
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(repeats):
        for b in sizes if r % 2 == 0 else tuple(reversed(sizes)):
            times[b].append(sessions.propose(pools[b]))
    return times


def curve_rows(times: dict[int, list[float]]) -> list[dict]:
    """Median S(B) and its ratio to S(1) (the smallest size measured) per batch size."""
    base = statistics.median(times[min(times)])
    rows = []
    for b in sorted(times):
        median = statistics.median(times[b])
        rows.append(
            {
                "batch": b,
                "median_ms": 1e3 * median,
                "min_ms": 1e3 * min(times[b]),
                "max_ms": 1e3 * max(times[b]),
                "per_job_ms": 1e3 * median / b,
                "ratio_to_1": median / base,
                "repeats": len(times[b]),
            }
        )
    return rows


def ratio_checks(rows: list[dict]) -> dict[str, Any]:
    """S(8)/S(1) and S(32)/S(1) against the issue's targets (None where not measured)."""
    by_batch = {r["batch"]: r["ratio_to_1"] for r in rows}
    out: dict[str, Any] = {}
    for b, limit in TARGET_RATIOS.items():
        ratio = by_batch.get(b)
        out[f"s{b}_over_s1"] = ratio
        out[f"s{b}_over_s1_ok"] = None if ratio is None else ratio <= limit
    return out


def session_memory(sessions: FakeSessions, count: int, context: int) -> dict[str, float]:
    """RSS added by ``count`` sessions holding ``context`` tokens, then by ``count`` more.

    The slope over two steps (MiB per ``count`` sessions) discounts one-off allocations.
    """
    gc.collect()
    before = rss_mb()
    held = sessions.open(count, context)
    gc.collect()
    first = rss_mb()
    held += sessions.open(count, context)
    gc.collect()
    second = rss_mb()
    del held
    return {
        "sessions": count,
        "context_tokens": context,
        "rss_before_mb": before,
        "rss_first_mb": first,
        "rss_second_mb": second,
        "mb_per_sessions": (second - before) / 2,
    }


def kv_mb_per_sessions(model_dir: str, count: int, context: int) -> float | None:
    """What the draft LLM's KV cache should take: layers x (K, V) x heads x head_dim x tokens."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    c = json.loads(path.read_text())
    heads = c.get("num_key_value_heads") or c.get("num_attention_heads") or c.get("n_head")
    layers = c.get("num_hidden_layers") or c.get("n_layer")
    hidden = c.get("hidden_size") or c.get("n_embd")
    if not (heads and layers and hidden):
        return None
    head_dim = c.get("head_dim") or hidden // (c.get("num_attention_heads") or c.get("n_head"))
    bytes_per_token = layers * 2 * heads * head_dim * 4  # float32, as the hub loads by default
    return count * context * bytes_per_token / 2**20


def load(kind: str, model: str, target: str) -> tuple[Any, int]:
    """The hub's proposer for ``kind`` and the vocabulary it drafts in."""
    from starsd.hub.build import load_proposer
    from starsd.hub.config import HubConfig

    config = HubConfig(model=model, draft_kind=kind, target=target if kind == "eagle" else None)
    proposer, info = load_proposer(config)
    return proposer, info.vocab_size


def measure(
    kind: str,
    model: str,
    target: str,
    sizes: tuple[int, ...],
    repeats: int,
    gamma: int,
    memory: bool,
) -> dict[str, Any]:
    """S(B) rows (and, with ``memory``, the RSS of held sessions) for one drafter."""
    print(
        f"[service] {kind} ({model}): S(B) for B = {list(sizes)}, {repeats} repeats ...", flush=True
    )
    proposer, vocab = load(kind, model, target)
    sessions = FakeSessions(proposer, vocab, gamma)
    rows = curve_rows(time_sizes(sessions, sizes, repeats))
    result: dict[str, Any] = {"kind": kind, "model": model, "rows": rows, **ratio_checks(rows)}
    if memory:
        mem = session_memory(sessions, RSS_SESSIONS, RSS_CONTEXT)
        result["memory"] = {
            **mem,
            "kv_mb_theory": kv_mb_per_sessions(model, RSS_SESSIONS, RSS_CONTEXT),
        }
    print(
        "  "
        + ", ".join(
            f"S({r['batch']}) {r['median_ms']:.1f} ms ({r['ratio_to_1']:.2f}x)" for r in rows
        ),
        flush=True,
    )
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every drafter asked for; the JSON written by ``main``."""
    import torch

    torch.set_num_threads(1)  # as the hub (--threads 1)
    sizes = tuple(int(b) for b in args.sizes)
    repeats = args.repeats or (7 if args.quick else 21)
    drafters: dict[str, Any] = {}
    drafters["llm"] = measure(
        "llm", args.draft, args.target, sizes, repeats, args.gamma, memory=not args.no_memory
    )
    if args.eagle and (Path(args.eagle) / "config.json").exists():
        drafters["eagle"] = measure(
            "eagle",
            args.eagle,
            args.target,
            sizes,
            repeats,
            args.gamma,
            memory=not (args.quick or args.no_memory),
        )
    else:
        print(f"[service] no EAGLE head at {args.eagle}: skipped", flush=True)
    return {
        "suite": "service",
        "gamma": args.gamma,
        "prompt_tokens": PROMPT_TOKENS,
        "accepted_per_round": ACCEPTED,
        "sizes": list(sizes),
        "repeats": repeats,
        "target_ratios": {f"s{b}_over_s1": v for b, v in TARGET_RATIOS.items()},
        "drafters": drafters,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """S(B) in ms and S(B) / S(1) against B, one line per drafter, with the loop's B * S(1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(10, 4))
    plot_curves(result, ax, ax_ratio)
    fig.suptitle(f"StarSD S(B): one propose() call for B sessions (gamma {result['gamma']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_curves(result: dict[str, Any], ax: Any, ax_ratio: Any | None = None) -> None:
    """Draw the S(B) curves on ``ax`` (and the ratios on ``ax_ratio``)."""
    for kind, d in result["drafters"].items():
        bs = [r["batch"] for r in d["rows"]]
        ax.plot(bs, [r["median_ms"] for r in d["rows"]], "o-", label=f"{kind} S(B)")
        if ax_ratio is not None:
            ax_ratio.plot(bs, [r["ratio_to_1"] for r in d["rows"]], "o-", label=kind)
    bs = result["sizes"]
    ax.set(xscale="log", yscale="log", xlabel="sessions in one batch B", ylabel="ms per batch")
    ax.legend()
    if ax_ratio is not None:
        ax_ratio.plot(bs, bs, ":", c="grey", label="B (one at a time)")
        ax_ratio.scatter(
            list(TARGET_RATIOS),
            list(TARGET_RATIOS.values()),
            marker="v",
            c="red",
            zorder=3,
            label="target",
        )
        ax_ratio.set(xscale="log", yscale="log", xlabel="B", ylabel="S(B) / S(1)")
        ax_ratio.legend()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from starsd import models

    p = argparse.ArgumentParser(
        prog="python -m scripts.bench.service", description=__doc__.split("\n")[0]
    )
    p.add_argument("--draft", default=str(models.TOY_DRAFT_DIR))
    p.add_argument("--target", default=str(models.TOY_TARGET_DIR))
    p.add_argument(
        "--eagle",
        default=str(models.TOY_TARGET_DIR.parent / "starsd-eagle"),
        help="EAGLE head directory ('' to skip)",
    )
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--repeats", type=int, default=0, help="default: 21 (7 with --quick)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(REPO / "results" / "bench-service.json"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-memory", action="store_true", help="skip the RSS of held sessions")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - started
    result["cpus"] = sorted(os.sched_getaffinity(0))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if not args.no_plot:
        plot(result, out.with_suffix(".png"))
    print(f"wrote {out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
