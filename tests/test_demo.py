"""The demo's path, shortened, on the committed default model pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.demo import distinct_ngrams
from starsd import models

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def test_default_models_are_committed_and_load() -> None:
    target = models.load_causal_lm(models.TOY_TARGET_DIR)
    draft = models.load_causal_lm(models.TOY_DRAFT_DIR)
    assert target.tokenizer_fingerprint == draft.tokenizer_fingerprint
    assert target.vocab_size == draft.vocab_size
    size = sum(
        p.stat().st_size
        for d in (models.TOY_TARGET_DIR, models.TOY_DRAFT_DIR)
        for p in d.glob("*.safetensors")
    )
    assert size <= 10 * 1024 * 1024


def test_shortened_demo(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.demo",
            "--pair",
            "toy",
            "--targets",
            "2",
            "--prompts-per-target",
            "1",
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("demo: pair=toy targets=2 speedup=") and last.endswith(
        "identical=yes"
    ), last
    summary = json.loads((tmp_path / "demo-toy.json").read_text())
    assert summary["identical"] and len(summary["per_target"]) == 2
    assert all(p["rounds"] > 0 and p["tokens"] == 12 for p in summary["per_target"])


def test_distinct_ngrams_tells_a_loop_from_text() -> None:
    """Catches a measure that counts n-grams across outputs (two identical answers would read
    as looping) or that a loop passes: the toy pair's "be be be" must read low."""
    loop = [7, 8] + [9] * 30
    assert distinct_ngrams([loop]) < 0.2
    assert distinct_ngrams([list(range(40)), list(range(40))]) == 1.0
