"""On a machine with CUDA: profile the SmolLM2 pair on the GPU and plan from the profiles.

    python -m scripts.bench.check_gpu_profile [--draft models/smollm2-draft]
        [--eagle3 models/smollm2-eagle3] [--target models/smollm2-135m-instruct]
        [--device cuda] [--out-dir profiles] [--plan results/plan-cuda.json]  # make check-gpu

Runs ``starsd profile target`` and ``starsd profile draft`` (the EAGLE-3 head, the pair's
default drafter, and the draft LLM) on ``--device`` (bfloat16), writing
profiles/measured-cuda-<model>.json, then ``starsd plan`` from each drafter's profile with the
target's: ``--plan`` (the head) and ``<plan>-llm.json`` (the draft LLM). Without
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
    """The ``starsd`` command lines: profile the target, each drafter (the EAGLE-3 head, the
    pair's default, and the draft LLM), and plan from each drafter's profile with the
    target's (``--plan`` for the head, ``*-llm.json`` beside it for the draft LLM)."""
    draft, target = profile_path(args.out_dir, args.draft), profile_path(args.out_dir, args.target)
    head = profile_path(args.out_dir, args.eagle3)
    common = ["--device", args.device, "--dtype", args.dtype]
    plan_llm = str(Path(args.plan).with_name(Path(args.plan).stem + "-llm.json"))
    head_kind = ["--draft-kind", "eagle3", "--target", args.target]
    return [
        ["profile", "target", "--model", args.target, *common, "--out", str(target)],
        ["profile", "draft", "--model", args.eagle3, *head_kind, *common, "--out", str(head)],
        ["profile", "draft", "--model", args.draft, *common, "--out", str(draft)],
        ["plan", "--draft", str(head), "--target", str(target), "--json", args.plan],
        ["plan", "--draft", str(draft), "--target", str(target), "--json", plan_llm],
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """argparse (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", default="models/smollm2-draft")
    p.add_argument("--eagle3", default="models/smollm2-eagle3", help="the pair's EAGLE-3 head")
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
