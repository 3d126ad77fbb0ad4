"""Batched verification on one target: ``--concurrency 8`` against ``--concurrency 1``.

    python -m scripts.bench.verify [--reps 3] [--max-new-tokens 64] [--out FILE.json]

Also run by ``scripts/bench/run.py --suite main`` (its ``batched_verification`` entry). Three
comparisons on the default pair, greedy, 1 torch thread per process:

* ``hub``: one hub (``--gamma 4``) and ONE ``edge.target`` process over 8 prompts at
  ``--concurrency 8`` vs ``--concurrency 1``, a fresh target process per run;
* ``standalone``: ``edge.target --standalone`` over the same prompts, concurrency 8 vs 1;
* ``forward``: the torch backend's raw forward of B = 8 verification rows (gamma + 1 = 5 tokens
  after a 64-token cache each) against B = 1, in this process.

The process pairs alternate (8, 1, 1, 8, ...: this machine's speed drifts); medians and their
ratios go to the JSON. A target's rate is its own summary line (tokens over the wall time of
decoding every prompt, model loading excluded). Targets: both ratios >= 4.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edge.backends.torch import TorchBackend
from scripts.bench.harness import PROMPTS, REPO, Processes, start_hub, stop, write_prompts
from starsd import models
from starsd.batch import SequenceCache

CONCURRENCIES = (8, 1)
SUMMARY = re.compile(
    r"done: \d+ sequences, (\d+) tokens in ([0-9.]+) s .*"
    r"mean rows per forward ([0-9.]+)"
)


def run(
    procs: Processes,
    work: Path,
    target: str,
    draft: str,
    reps: int = 3,
    max_new_tokens: int = 64,
    gamma: int = 4,
) -> dict[str, Any]:
    """The three comparisons (see the module docstring); a JSON-ready dict."""
    prompts = work / "verify-prompts.jsonl"
    write_prompts(prompts, PROMPTS[:8])
    args = [
        "--model",
        target,
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        str(max_new_tokens),
        "--threads",
        "1",
    ]
    hub, endpoint = start_hub(procs, draft, work / "verify-hub.log", "--gamma", str(gamma))
    try:
        with_hub = alternate(
            lambda c, tag: target_run(
                procs, work, [*args, "--hub", endpoint, "--gamma", str(gamma)], c, tag
            ),
            reps,
            "hub",
        )
    finally:
        stop(hub)
    alone = alternate(
        lambda c, tag: target_run(procs, work, [*args, "--standalone"], c, tag), reps, "standalone"
    )
    return {"hub": with_hub, "standalone": alone, "forward": forward_ratio(target, gamma)}


def target_run(
    procs: Processes, work: Path, args: list[str], concurrency: int, tag: str
) -> dict[str, float]:
    """One ``edge.target`` process; its tokens/s and mean rows per forward (summary line)."""
    log = work / f"verify-{tag}.log"
    proc = procs.start(
        [
            "-m",
            "edge.target",
            *args,
            "--concurrency",
            str(concurrency),
            "--out",
            str(work / f"verify-{tag}.jsonl"),
        ],
        log,
    )
    if proc.wait(timeout=900) != 0:
        raise RuntimeError(f"target {tag} failed; see {log}")
    found = SUMMARY.search(log.read_text())
    if found is None:
        raise RuntimeError(f"no summary line in {log}")
    tokens, wall, rows = int(found[1]), float(found[2]), float(found[3])
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "rows_per_forward": rows}


def alternate(
    measure: Callable[[int, str], dict[str, float]], reps: int, name: str
) -> dict[str, Any]:
    """``reps`` runs of each concurrency, the order flipping every repetition; medians, ratio."""
    runs: dict[int, list[dict[str, float]]] = {c: [] for c in CONCURRENCIES}
    for rep in range(reps):
        for c in CONCURRENCIES if rep % 2 == 0 else CONCURRENCIES[::-1]:
            runs[c].append(measure(c, f"{name}-c{c}-{rep}"))
            print(
                f"[verify] {name} --concurrency {c}: {runs[c][-1]['tokens_per_s']:.1f} tok/s, "
                f"{runs[c][-1]['rows_per_forward']:.2f} rows per forward",
                flush=True,
            )
    median = {c: statistics.median(r["tokens_per_s"] for r in runs[c]) for c in runs}
    return {
        "tokens_per_s": {str(c): [r["tokens_per_s"] for r in runs[c]] for c in runs},
        "median_tokens_per_s": {str(c): median[c] for c in runs},
        "rows_per_forward": {
            str(c): statistics.median(r["rows_per_forward"] for r in runs[c]) for c in runs
        },
        "ratio_8_vs_1": median[8] / median[1],
    }


def forward_ratio(target: str, gamma: int, cached: int = 64, repeats: int = 15) -> dict[str, Any]:
    """Median time of one torch-backend forward of B verification rows (gamma + 1 tokens after
    ``cached`` positions each), B = 1 and 8 alternated, and the ratio."""
    torch.set_num_threads(1)
    backend = TorchBackend(models.load_causal_lm(target))
    (prefix,) = backend.forward([SequenceCache()], [list(range(1, cached + 1))])
    feed = list(range(100, 100 + gamma + 1))
    times: dict[int, list[float]] = {1: [], 8: []}
    for rep in range(repeats + 2):  # the first two of each warm up
        for b in (1, 8) if rep % 2 == 0 else (8, 1):
            started = time.perf_counter()
            backend.forward([prefix.cache] * b, [feed] * b)
            if rep >= 2:
                times[b].append(time.perf_counter() - started)
    ms = {b: 1e3 * statistics.median(t) for b, t in times.items()}
    return {
        "gamma": gamma,
        "cached": cached,
        "ms": {str(b): m for b, m in ms.items()},
        "ratio_8_vs_1": ms[8] / ms[1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(models.TOY_TARGET_DIR))
    p.add_argument("--draft", default=str(models.TOY_DRAFT_DIR))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "results" / "bench-verify.json"))
    a = p.parse_args(argv)
    procs = Processes()
    try:
        with tempfile.TemporaryDirectory(prefix="starsd-verify-") as tmp:
            result = run(procs, Path(tmp), a.target, a.draft, a.reps, a.max_new_tokens, a.gamma)
    finally:
        procs.stop_all()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: {"ratio_8_vs_1": v["ratio_8_vs_1"]} for k, v in result.items()}))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
