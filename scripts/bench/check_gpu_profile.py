"""On a machine with CUDA: profile the SmolLM2 pair on the GPU and plan from the profiles.

    python -m scripts.bench.check_gpu_profile [--draft models/smollm2-draft]
        [--eagle3 models/smollm2-eagle3] [--target models/smollm2-135m-instruct]
        [--device cuda] [--batch 1,2,4,8,16,32,64] [--out-dir profiles]
        [--plan results/plan-cuda.json] [--acceptance results/train-real-eagle-heads.json]
        [--stand-in-weights]  # make check-gpu

Runs ``starsd profile target`` and ``starsd profile draft`` (the EAGLE-3 head, the pair's
default drafter, and the draft LLM) on ``--device`` (bfloat16), writing
profiles/measured-cuda-<model>.json, then ``starsd plan`` from each drafter's profile with the
target's: ``--plan`` (the head) and ``<plan>-llm.json`` (the draft LLM), a PNG beside each,
with that drafter's acceptance at gamma 4 as measured on held-out prompts by the training report
(``--acceptance``; acceptance is the models', not the device's). Without CUDA it prints one
line saying so and exits 0 (make check-gpu's other steps are unaffected).

``--stand-in-weights`` is for a GPU machine the target's weights cannot reach (one reached
through a small file transfer, say: the float32 target is 538 MB): when the target directory
holds its config but no weights, random weights of exactly its tensors' names, shapes and
dtype are written with the converter's writer (so the profile's model fingerprint, which reads
the config, the parameter count and the weight files' sizes, is the real model's) with a marker
file beside them, and every target profile made of them says so in its ``notes``. A dense
forward's time does not depend on its weights' values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from starsd import cli
from starsd.profile import WEIGHT_SUFFIXES, write_profile

SKIP_LINE = "check-gpu: CUDA not available: skipping starsd profile draft/target and plan on cuda"
STAND_IN_NOTE = (
    "weights: random, of the real model's tensor names, shapes and dtype (the real weights "
    "could not reach this machine); the times are the real model's, nothing else is"
)
STAND_IN_MARKER = "stand-in-weights.txt"  # beside the stand-in weights: no weight suffix
ACCEPTANCE_GAMMA = 4
DRAFTERS = {"eagle3": "eagle3", "llm": "llm"}  # plan name -> the training report's key


def profile_path(out_dir: str, model: str) -> Path:
    """Where a model's CUDA profile goes: ``OUT_DIR/measured-cuda-<model dir name>.json``."""
    return Path(out_dir) / f"measured-cuda-{Path(model).name}.json"


def plan_paths(plan: str) -> dict[str, str]:
    """The plan JSON per drafter: ``--plan`` for the head, ``<plan>-llm.json`` for the LLM."""
    return {"eagle3": plan, "llm": str(Path(plan).with_name(Path(plan).stem + "-llm.json"))}


def commands(
    args: argparse.Namespace, acceptance: dict[str, Path] | None = None
) -> list[list[str]]:
    """The ``starsd`` command lines: profile the target, each drafter (the EAGLE-3 head, the
    pair's default, and the draft LLM), and plan from each drafter's profile with the
    target's, with that drafter's acceptance file where there is one."""
    draft, target = profile_path(args.out_dir, args.draft), profile_path(args.out_dir, args.target)
    head = profile_path(args.out_dir, args.eagle3)
    common = ["--device", args.device, "--dtype", args.dtype, "--batch", args.batch]
    head_kind = ["--draft-kind", "eagle3", "--target", args.target]
    plans = plan_paths(args.plan)
    drafts = {"eagle3": head, "llm": draft}
    return [
        ["profile", "target", "--model", args.target, *common, "--out", str(target)],
        ["profile", "draft", "--model", args.eagle3, *head_kind, *common, "--out", str(head)],
        ["profile", "draft", "--model", args.draft, *common, "--out", str(draft)],
        *(
            ["plan", "--draft", str(drafts[name]), "--target", str(target), "--json", plans[name]]
            + ["--plot", str(Path(plans[name]).with_suffix(".png"))]
            + (["--acceptance", str(acceptance[name])] if acceptance and name in acceptance else [])
            for name in DRAFTERS
        ),
    ]


def acceptance_files(report: Path, out_dir: Path) -> dict[str, Path]:
    """One acceptance file per drafter (``{"mean_accepted", "gamma"}`` at ACCEPTANCE_GAMMA)
    from the training report's held-out evaluation; none when the report is absent."""
    if not report.exists():
        return {}
    evaluation = json.loads(report.read_text())["evaluation"]
    files = {}
    for name, key in DRAFTERS.items():
        measured = evaluation[key][str(ACCEPTANCE_GAMMA)]
        path = out_dir / f"acceptance-{name}.json"
        body = {"mean_accepted": measured["mean_accepted"], "gamma": ACCEPTANCE_GAMMA}
        path.write_text(json.dumps({**body, "source": str(report)}, indent=1) + "\n")
        files[name] = path
    return files


def has_weights(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds weight files (those the model fingerprint reads)."""
    return any(p.suffix in WEIGHT_SUFFIXES for p in model_dir.iterdir())


def write_stand_in_weights(model_dir: Path, seed: int = 0) -> None:
    """Random float32 weights of ``model_dir``'s config, written as the converter writes the
    real ones (same tensor names, order, shapes and metadata, so the same file size)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from scripts.train.real_target import saved_tensors

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = saved_tensors(model)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / STAND_IN_MARKER).write_text(STAND_IN_NOTE + "\n")


def has_stand_in_weights(model_dir: Path) -> bool:
    """Whether ``model_dir``'s weights were written by :func:`write_stand_in_weights`."""
    return (model_dir / STAND_IN_MARKER).exists()


def note_stand_in(profile: Path) -> None:
    """Add STAND_IN_NOTE to a written profile's ``notes``."""
    raw = json.loads(profile.read_text())
    notes = raw.get("notes") or []
    raw["notes"] = [*([notes] if isinstance(notes, str) else notes), STAND_IN_NOTE]
    write_profile(raw, profile)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """argparse (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", default="models/smollm2-draft")
    p.add_argument("--eagle3", default="models/smollm2-eagle3", help="the pair's EAGLE-3 head")
    p.add_argument("--target", default="models/smollm2-135m-instruct")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--batch", default="1,2,4,8,16,32,64", help="batch sizes profiled")
    p.add_argument("--out-dir", default="profiles")
    p.add_argument("--plan", default="results/plan-cuda.json")
    p.add_argument("--acceptance", default="results/train-real-eagle-heads.json")
    p.add_argument("--stand-in-weights", action="store_true", help="see the module docstring")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Profile and plan on CUDA; 0 and one line when there is none."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(SKIP_LINE, flush=True)
        return 0
    Path(args.plan).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    if args.stand_in_weights and not has_weights(Path(args.target)):
        print(f"check-gpu: {args.target}: no weights; writing stand-in weights", flush=True)
        write_stand_in_weights(Path(args.target))
    stand_in = has_stand_in_weights(Path(args.target))
    acceptance = acceptance_files(Path(args.acceptance), Path(args.plan).parent)
    for command in commands(args, acceptance):
        print(f"check-gpu: starsd {' '.join(command)}", flush=True)
        status = cli.main(command)
        if status:
            return status
        if stand_in and command[:2] == ["profile", "target"]:
            note_stand_in(profile_path(args.out_dir, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
