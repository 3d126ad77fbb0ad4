"""On a machine with an NVIDIA GPU: the onnxruntime backend's CUDA and TensorRT providers
against the torch backend, exactness and tokens/s. Not run on the CPU-only machines
StarSD is developed on.

    python -m scripts.bench.check_gpu_backends [--model models/starsd-target] [--export DIR]
        [--max-new-tokens 64] [--prompts 6] [--out results/gpu-backends.json]

Needs torch with CUDA and onnxruntime-gpu (TensorRT libraries for the TensorRT provider). The
export (float32) is made first if DIR has none. For each of torch (CUDA), ONNX Runtime CUDA and
ONNX Runtime TensorRT (a provider this onnxruntime lacks is reported as skipped) it prints:
whether greedy tokens equal the torch CPU reference token for token (and the first position
that differs), the largest logit difference on the export's probe, start-up time (TensorRT:
engine build on a cold cache, then again on the warm cache), and greedy tokens/s at batch 1 and
with every prompt in one ragged batch. Exit status 1 if any provider that ran was not exact.
``--out`` is written only where CUDA is (make check-gpu on a CPU machine keeps the committed
report of the last GPU machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edge import export as exporter
from edge.backends.base import VerifierBackend
from edge.backends.greedy import greedy
from edge.backends.onnxruntime import CUDA, TRT, OnnxBackend, OnnxOptions, TrtProfile
from scripts.bench.harness import PROMPTS
from scripts.bench.onnx import TorchRagged
from starsd import models
from starsd.batch import SequenceCache


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Index of the first token (counted over all prompts) where ``a`` and ``b`` differ."""
    flat_a, flat_b = [t for row in a for t in row], [t for row in b for t in row]
    pairs = enumerate(zip(flat_a, flat_b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), None if a == b else min(map(len, (a, b))))


def probe_error(backend: VerifierBackend, reference: torch.Tensor, ids: list[int]) -> float:
    """Largest |logit - torch CPU logit| on the probe (prefix cached, rest fed)."""
    half = len(ids) // 2
    first = backend.forward([SequenceCache()], [ids[:half]])[0]
    logits = backend.forward([first.cache], [ids[half:]])[0].logits
    return float((logits - reference).abs().max())


def timed(
    make: Callable[[], VerifierBackend],
    prompts: list[list[int]],
    n: int,
    reference: list[list[int]],
    probe: tuple[torch.Tensor, list[int]],
) -> dict[str, Any]:
    """Start-up, exactness and tokens/s of one backend."""
    started = time.perf_counter()
    backend = make()
    startup = time.perf_counter() - started
    greedy(backend, prompts[:1], 4)  # warm-up (TensorRT builds or loads its engine here)
    warm = time.perf_counter() - started
    started = time.perf_counter()
    single = [greedy(backend, [p], n)[0] for p in prompts]
    single_rate = sum(map(len, single)) / (time.perf_counter() - started)
    started = time.perf_counter()
    batched = greedy(backend, prompts, n)
    batched_rate = sum(map(len, batched)) / (time.perf_counter() - started)
    return {
        "startup_s": round(startup, 2),
        "first_tokens_s": round(warm, 2),
        "exact": single == reference and batched == reference,
        "first_difference": first_difference(single, reference),
        "probe_max_abs_diff": probe_error(backend, *probe),
        "tokens_per_s_batch1": round(single_rate, 2),
        "tokens_per_s_batched": round(batched_rate, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(models.TOY_TARGET_DIR))
    p.add_argument("--export", default=str(Path(tempfile.gettempdir()) / "starsd-target-onnx"))
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", help="write the report here as JSON")
    args = p.parse_args(argv)
    import onnxruntime as ort

    if not (Path(args.export) / "manifest.json").exists():
        exporter.export(args.model, args.export)
    cpu = models.load_causal_lm(args.model)
    prompts = [models.encode_text(cpu, t) for t in PROMPTS[: args.prompts]]
    reference = greedy(TorchRagged(cpu), prompts, args.max_new_tokens)
    manifest = OnnxBackend(args.export, OnnxOptions(providers=("cpu",), check_probe=False))
    ids = manifest.manifest.probe.first + manifest.manifest.probe.second
    probe = (torch.tensor(manifest.manifest.probe.logits), ids)
    engines: dict[str, Callable[[], VerifierBackend]] = {}
    if torch.cuda.is_available():
        engines["torch-cuda"] = lambda: TorchRagged(models.load_causal_lm(args.model, "cuda"))
    cache = Path(tempfile.mkdtemp(prefix="trt-engines-"))
    for name in (CUDA, TRT, TRT):  # TensorRT twice: a cold engine cache, then a warm one
        if name in ort.get_available_providers():
            options = OnnxOptions(providers=(name,), trt=TrtProfile(cache_dir=str(cache)))
            key = f"onnxruntime-{name}"
            key += "-warm-cache" if key in engines else ""
            engines[key] = lambda o=options: OnnxBackend(args.export, o)  # type: ignore[misc]
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "onnxruntime": ort.__version__,
        "providers_available": ort.get_available_providers(),
        "tokens": sum(map(len, reference)),
    }
    for name, make in engines.items():
        try:
            report[name] = timed(make, prompts, args.max_new_tokens, reference, probe)
        except Exception as exc:  # report every provider, whatever one of them does
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    for name in (CUDA, TRT):
        report.setdefault(f"onnxruntime-{name}", {"skipped": "not in this onnxruntime build"})
    text = json.dumps(report, indent=1)
    print(text)
    if args.out and report["gpu"] is None:  # a CPU machine's run must not replace a GPU's record
        print(f"check-gpu: no CUDA device: {args.out} not written", flush=True)
    elif args.out:
        Path(args.out).write_text(text + "\n")
    ran = [v for v in report.values() if isinstance(v, dict) and "exact" in v]
    return 0 if all(v["exact"] for v in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
