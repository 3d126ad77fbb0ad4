"""On a machine with CUDA: one hub + one target on the GPU against the target alone there.

    python -m scripts.bench.check_gpu_pair [--target models/starsd-target]
        [--draft models/starsd-draft] [--device cuda] [--dtype float32] [--prompts 6]
        [--max-new-tokens 64] [--repeats 2] [--out results/gpu-pair.json]  # make check-gpu

Starts ``python -m starsd.hub`` on ``--device`` and runs ``python -m edge.target`` on it,
``--standalone`` and through the hub, alternated ``--repeats`` times (order rotated), greedy
over the first ``--prompts`` of the benchmarks' prompts. Prints and writes each mode's decode
tokens/s (tokens over the sequences' own decode seconds, model loading left out), the ratio,
the hub's mean accepted drafts per round, and whether every greedy output through the hub
equals the target alone token for token, with the hub's closing summary lines and any ERROR
line it logged (exit 1 on either a differing output or a hub error). The committed toy pair is
the default: its weights travel with the checkout. Without CUDA it prints one line saying so and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from scripts.bench.common import rotated
from scripts.bench.harness import PROMPTS, REPO, Processes, start_hub, write_prompts

SKIP_LINE = "check-gpu: CUDA not available: skipping the hub + target pair on cuda"
MODES = ("standalone", "hub")


def target_command(args: argparse.Namespace, prompts: Path, hub: str | None) -> list[str]:
    """``python -m edge.target`` over ``prompts`` on the device, alone or through ``hub``."""
    where = ["--hub", hub] if hub else ["--standalone"]
    device = ["--device", args.device, "--dtype", args.dtype]
    run = ["--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens)]
    return [sys.executable, "-m", "edge.target", "--model", args.target, *run, *device, *where]


def decode_figures(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s over the sequences' decode seconds, mean accepted drafts per round, the ids."""
    tokens = sum(len(r["token_ids"]) for r in lines)
    seconds = sum(len(r["token_ids"]) / r["stats"]["tokens_per_s"] for r in lines)
    rounds = sum(r["stats"]["rounds"] for r in lines)
    accepted = sum(r["stats"]["accepted"] for r in lines)
    return {
        "tokens_per_s": tokens / seconds,
        "mean_accepted": accepted / rounds if rounds else 0.0,
        "token_ids": [r["token_ids"] for r in sorted(lines, key=lambda r: r["id"])],
    }


def run_target(command: list[str], out: Path) -> dict[str, Any]:
    """Run one target process to its end (its log beside ``out``); its decode figures."""
    log = out.with_suffix(".log")
    with log.open("wb") as sink:
        done = subprocess.run(
            [*command, "--out", str(out)], check=False, cwd=REPO, stderr=sink, timeout=600
        )
    if done.returncode:
        raise RuntimeError(
            f"{' '.join(command)} exited {done.returncode}:\n{log.read_text()[-3000:]}"
        )
    return decode_figures([json.loads(line) for line in out.read_text().splitlines()])


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median tokens/s per mode, the ratio, acceptance, and greedy identity on every run."""
    rates = {m: statistics.median(r["tokens_per_s"] for r in runs[m]) for m in MODES}
    reference = runs["standalone"][0]["token_ids"]
    return {
        "tokens_per_s": rates,
        "hub_over_standalone": rates["hub"] / rates["standalone"],
        "mean_accepted": statistics.mean(r["mean_accepted"] for r in runs["hub"]),
        "identical": all(r["token_ids"] == reference for m in MODES for r in runs[m]),
    }


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The hub on the device, then both modes alternated ``--repeats`` times."""
    prompts = write_prompts(scratch / "prompts.jsonl", PROMPTS[: args.prompts])
    procs = Processes()
    try:
        device = ["--device", args.device, "--dtype", args.dtype]
        _, endpoint = start_hub(procs, args.draft, scratch / "hub.log", *device)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for repeat in range(args.repeats):
            for mode in rotated(MODES, repeat):
                hub = endpoint if mode == "hub" else None
                out = scratch / f"{mode}-{repeat}.jsonl"
                runs[mode].append(run_target(target_command(args, prompts, hub), out))
                print(f"check-gpu: {mode} {runs[mode][-1]['tokens_per_s']:.1f} tok/s", flush=True)
    finally:
        procs.stop_all()
    return {**summary(runs), **hub_report((scratch / "hub.log").read_text(errors="replace"))}


def hub_report(log: str) -> dict[str, Any]:
    """What the hub's log says of the run: its closing summary lines (S(B), queue wait,
    pre-draft hits, failed rounds) and every ERROR line, so a shortfall on a machine that is
    gone afterwards can still be read."""
    lines = log.splitlines()
    stopped = max((i for i, line in enumerate(lines) if "hub stopped after" in line), default=None)
    closing = lines[stopped + 1 :] if stopped is not None else []
    return {
        "hub_summary": [line.split(" INFO ", 1)[1] for line in closing if _level(line) == "INFO"],
        "hub_errors": [line for line in lines if _level(line) == "ERROR"],
    }


def _level(line: str) -> str | None:
    """A log line's level ("%(asctime)s %(name)s %(levelname)s %(message)s"), None for a line
    of another kind (a traceback's)."""
    fields = line.split(" ", 4)
    return fields[3] if len(fields) > 3 else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """argparse (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="models/starsd-target")
    p.add_argument("--draft", default="models/starsd-draft")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="results/gpu-pair.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure and write; 0 and one line without CUDA; 1 if an output differed."""
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(SKIP_LINE, flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="starsd-gpu-pair-") as scratch:
        result = measure(args, Path(scratch))
    config = {k: getattr(args, k) for k in ("target", "draft", "device", "dtype", "repeats")}
    report = {"config": config, **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    rates = result["tokens_per_s"]
    print(
        f"check-gpu: pair on {args.device}: hub {rates['hub']:.1f} tok/s, standalone "
        f"{rates['standalone']:.1f} tok/s ({result['hub_over_standalone']:.2f}x), "
        f"mean accepted {result['mean_accepted']:.2f}, identical {result['identical']}"
    )
    for line in result["hub_errors"]:
        print(f"check-gpu: hub: {line}")
    return 0 if result["identical"] and not result["hub_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
