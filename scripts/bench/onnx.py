"""ONNX Runtime CPU backend vs torch CPU on the default target: greedy tokens/s, one run.

    python -m scripts.bench.onnx [--model models/starsd-target] [--export DIR] [--rounds 3]
                                 [--max-new-tokens 64] [--out results/bench-onnx.json]

Each engine decodes the same prompts greedily, one thread each, alternated round by round
(A B C A B C ...: this machine's speed drifts) and the outputs must be identical token for token:

    torch-dynamic  today's standalone path: transformers with a DynamicCache, one prompt at a time
    torch-ragged   the torch backend's path (RaggedBatch gather, forward_batch, scatter)
    onnxruntime    the exported decoder on the CPU execution provider

both at batch 1 (prompts one after another) and with all prompts in one ragged batch. The export
is made first if DIR has none (``python -m edge.export``, minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from edge import export as exporter
from edge.backends.base import ModelInfo, RowOutput
from edge.backends.greedy import greedy
from edge.backends.onnxruntime import OnnxBackend, OnnxOptions
from scripts.bench.harness import PROMPTS
from starsd import models
from starsd.batch import RaggedBatch, SequenceCache
from starsd.llama import PaddedKeyValues

Engine = Callable[[list[list[int]]], list[list[int]]]


class TorchRagged:
    """The torch backend's forward (as edge/backends/torch.py does it), for timing."""

    def __init__(self, loaded: models.LoadedModel) -> None:
        self.loaded, self.shapes = loaded, models.kv_shapes(loaded)
        self.info = ModelInfo(
            loaded.name,
            loaded.vocab_size,
            models.hidden_size(loaded),
            loaded.tokenizer_fingerprint,
            loaded.eos_token_ids,
            loaded.max_positions,
        )

    def encode(self, text: str) -> list[int]:
        return models.encode_text(self.loaded, text)

    def decode(self, ids: Sequence[int]) -> str:
        return models.decode_ids(self.loaded, list(ids))

    def forward(
        self,
        caches: Sequence[SequenceCache],
        feeds: Sequence[Sequence[int]],
        features: bool = False,
    ) -> list[RowOutput]:
        batch = RaggedBatch(tuple(c.length for c in caches), tuple(map(len, feeds)), 0)
        buffers = batch.gather(caches, self.shapes, torch.float32, self.loaded.device)
        logits, _ = models.forward_batch(
            self.loaded,
            batch.input_ids(feeds),
            batch.feed_positions(),
            PaddedKeyValues(buffers, batch.mask(batch.capacity)),
        )
        return [
            RowOutput(logits[row, :f], None, batch.scatter(buffers, row, 0))
            for row, f in enumerate(batch.fed)
        ]


def dynamic_greedy(loaded: models.LoadedModel, prompt: list[int], n: int) -> list[int]:
    """Today's standalone decoding: prefill, then one DynamicCache forward per token."""
    cache, out = models.new_cache(loaded), []
    logits = models.forward(loaded, prompt, cache)
    while True:
        out.append(int(logits[-1].argmax()))
        if out[-1] in loaded.eos_token_ids or len(out) >= n:
            return out
        logits = models.forward(loaded, [out[-1]], cache)


def engines(loaded: models.LoadedModel, onnx: OnnxBackend, n: int) -> dict[str, Engine]:
    ragged = TorchRagged(loaded)
    return {
        "torch-dynamic": lambda ps: [dynamic_greedy(loaded, p, n) for p in ps],
        "torch-ragged": lambda ps: [greedy(ragged, [p], n)[0] for p in ps],
        "onnxruntime": lambda ps: [greedy(onnx, [p], n)[0] for p in ps],
        "torch-ragged-batched": lambda ps: greedy(ragged, ps, n),
        "onnxruntime-batched": lambda ps: greedy(onnx, ps, n),
    }


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    export_dir = Path(args.export)
    if not (export_dir / "manifest.json").exists():
        exporter.export(args.model, export_dir)
    loaded = models.load_causal_lm(args.model)
    onnx = OnnxBackend(export_dir, OnnxOptions(providers=("CPUExecutionProvider",), threads=1))
    prompts = [models.encode_text(loaded, p) for p in PROMPTS[: args.prompts]]
    named = engines(loaded, onnx, args.max_new_tokens)
    rates: dict[str, list[float]] = {name: [] for name in named}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, engine in named.items():
            started = time.perf_counter()
            outputs[name] = engine(prompts)
            wall = time.perf_counter() - started
            rates[name].append(sum(map(len, outputs[name])) / wall)
    identical = all(out == outputs["torch-dynamic"] for out in outputs.values())
    median = {name: statistics.median(r) for name, r in rates.items()}
    return {
        "model": str(args.model),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "threads": 1,
        "identical_greedy": identical,
        "tokens_per_s_median": {k: round(v, 2) for k, v in median.items()},
        "tokens_per_s_all": {k: [round(x, 2) for x in v] for k, v in rates.items()},
        "onnx_over_torch_dynamic": round(median["onnxruntime"] / median["torch-dynamic"], 3),
        "onnx_over_torch_ragged": round(median["onnxruntime"] / median["torch-ragged"], 3),
        "onnx_over_torch_batched": round(
            median["onnxruntime-batched"] / median["torch-ragged-batched"], 3
        ),
        "tokens": sum(map(len, outputs["onnxruntime"])),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(models.TOY_TARGET_DIR))
    p.add_argument("--export", default="/tmp/starsd-target-onnx", help="made if absent")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["identical_greedy"] else 1


if __name__ == "__main__":
    sys.exit(main())
