"""On a machine with CUDA: profile the SmolLM2 pair on the GPU and plan from the profiles.

    python -m scripts.bench.check_gpu_profile [--draft models/smollm2-draft]
        [--target models/smollm2-135m-instruct] [--device cuda] [--out-dir profiles]
        [--plan results/plan-cuda.json]          # part of make check-gpu

Runs ``starsd profile draft`` and ``starsd profile target`` on ``--device`` (bfloat16), writing
profiles/measured-cuda-<model>.json, then ``starsd plan`` from the two into ``--plan``. Without
CUDA it prints one line saying so and exits 0 (make check-gpu's other steps are unaffected).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from starsd import cli

SKIP_LINE = "check-gpu: CUDA not available: skipping starsd profile draft/target and plan on cuda"


def profile_path(out_dir: str, model: str) -> Path:
    """Where a model's CUDA profile goes: ``OUT_DIR/measured-cuda-<model dir name>.json``."""
    return Path(out_dir) / f"measured-cuda-{Path(model).name}.json"


def commands(args: argparse.Namespace) -> list[list[str]]:
    """The three ``starsd`` command lines: profile draft, profile target, plan."""
    draft, target = profile_path(args.out_dir, args.draft), profile_path(args.out_dir, args.target)
    common = ["--device", args.device, "--dtype", args.dtype]
    return [
        ["profile", "draft", "--model", args.draft, *common, "--out", str(draft)],
        ["profile", "target", "--model", args.target, *common, "--out", str(target)],
        ["plan", "--draft", str(draft), "--target", str(target), "--json", args.plan],
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """argparse (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", default="models/smollm2-draft")
    p.add_argument("--target", default="models/smollm2-135m-instruct")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--out-dir", default="profiles")
    p.add_argument("--plan", default="results/plan-cuda.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Profile and plan on CUDA; 0 and one line when there is none."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(SKIP_LINE, flush=True)
        return 0
    Path(args.plan).parent.mkdir(parents=True, exist_ok=True)
    for command in commands(args):
        print(f"check-gpu: starsd {' '.join(command)}", flush=True)
        status = cli.main(command)
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
