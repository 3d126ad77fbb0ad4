"""Export a target model for the ``onnxruntime`` backend: one ONNX decoder with KV cache.

    python -m edge.export MODEL_DIR OUT_DIR [--dtype float32|float16] [--providers cpu] [--force]

MODEL_DIR is any transformers causal-LM directory (Llama- and GPT-2-shaped models are tested),
loaded through ``starsd.models``. OUT_DIR receives ``model.onnx`` with

    inputs   input_ids [B, n], position_ids [B, n], attention_mask [B, T + n] (1 = a real key),
             past.{i}.key / past.{i}.value [B, heads, T, d] per layer (T may be 0: a prefill)
    outputs  logits [B, n, V], hidden [B, n, H] (the last hidden state, for EAGLE hubs),
             present.{i}.key / present.{i}.value [B, heads, T + n, d]

(batch, n and T dynamic), ``manifest.json`` (:mod:`edge.backends.onnx_manifest`) and the tokenizer
files. The export checks itself before it is kept: the tokenizers library must encode and decode
like the transformers tokenizer and give the same fingerprint, and ONNX Runtime's logits must
match the torch model's on a probe and on a ragged batch within float tolerance; otherwise the
output is deleted and the command fails naming the difference.

The graph is traced by ``torch.onnx.export(dynamo=True)`` through a thin wrapper
(``starsd.models.forward_explicit``) that builds a transformers cache from the explicit past
tensors: optimum's exporter (optimum-onnx 0.1) requires transformers 4.x, and StarSD is on 5.x.
Needs torch, transformers, onnx and onnxscript (the ``export`` extra); a target does not.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from edge.backends import onnx_manifest
from edge.backends.onnx_manifest import Manifest, ManifestError, Probe
from edge.backends.onnxruntime import BackendError, OnnxBackend, OnnxOptions, parse_providers
from starsd import models
from starsd.batch import SequenceCache

log = logging.getLogger("edge.export")
PROG = "python -m edge.export"
# Texts the tokenizers library must encode and decode exactly like transformers.
TOKENIZER_CHECKS = (
    onnx_manifest.PROBE_TEXT,
    "Hello, world!",
    "  two  spaces\nand a newline",
    "ALL CAPS 12345 and punctuation?!;",
)


class ExportError(RuntimeError):
    """The export cannot be made, or failed its own check (nothing is left behind)."""


class _Decoder(torch.nn.Module):
    """What is traced: the model with its KV cache as explicit inputs and outputs."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, ...]:
        return models.forward_explicit(self.model, input_ids, position_ids, attention_mask, past)


def export_graph(loaded: models.LoadedModel, path: Path, opset: int | None) -> int:
    """Trace the decoder into ``path``; returns the ONNX opset it was written with."""
    import onnx

    shapes = models.kv_shapes(loaded)
    batch, n, past_len = 2, 3, 4  # distinct sizes above 1, so none is specialised away
    dtype = next(loaded.model.parameters()).dtype
    past = [
        (
            torch.zeros(batch, h, past_len, d, dtype=dtype),
            torch.zeros(batch, h, past_len, d, dtype=dtype),
        )
        for h, d in shapes
    ]
    args = (
        torch.zeros(batch, n, dtype=torch.long),
        torch.arange(past_len, past_len + n).repeat(batch, 1),
        torch.ones(batch, past_len + n, dtype=torch.long),
        past,
    )
    b, f = torch.export.Dim("batch"), torch.export.Dim("n")
    t = torch.export.Dim("past", min=0)
    dynamic = {
        "input_ids": {0: b, 1: f},
        "position_ids": {0: b, 1: f},
        "attention_mask": {0: b, 1: torch.export.Dim.AUTO},
        "past": [({0: b, 2: t}, {0: b, 2: t}) for _ in shapes],
    }
    layers = len(shapes)
    with torch.no_grad(), warnings.catch_warnings():
        # The exporter's notes on axis renaming and pytree internals say nothing to act on.
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.onnx")
        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.onnx.export(
            _Decoder(loaded.model).eval(),
            args,
            str(path),
            dynamo=True,
            dynamic_shapes=dynamic,
            opset_version=opset,
            verbose=False,
            input_names=onnx_manifest.input_names(layers),
            output_names=onnx_manifest.output_names(layers),
        )
    graph = onnx.load(str(path), load_external_data=False)
    return int(next(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")))


def save_tokenizer(loaded: models.LoadedModel, out: Path) -> None:
    """Write the tokenizer files; ExportError unless the tokenizers library reads them back
    exactly as transformers encodes, decodes and fingerprints."""
    from tokenizers import Tokenizer

    loaded.tokenizer.save_pretrained(str(out))
    path = out / onnx_manifest.TOKENIZER_FILE
    if not path.is_file():
        raise ExportError(
            "the tokenizer wrote no tokenizer.json (a slow tokenizer?); the "
            "onnxruntime backend reads tokenizer.json with the tokenizers library"
        )
    tok = Tokenizer.from_file(str(path))
    fingerprint = models.fingerprint_of(
        tok.get_vocab(with_added_tokens=True), loaded.tokenizer.all_special_tokens
    )
    if fingerprint != loaded.tokenizer_fingerprint:
        raise ExportError(
            f"tokenizer.json fingerprints as {fingerprint}, transformers as "
            f"{loaded.tokenizer_fingerprint}"
        )
    for text in TOKENIZER_CHECKS:
        ids = models.encode_text(loaded, text)
        if tok.encode(text).ids != ids:
            raise ExportError(
                f"tokenizers encodes {text!r} as {tok.encode(text).ids}, transformers as {ids}"
            )
        if tok.decode(ids, skip_special_tokens=True) != models.decode_ids(loaded, ids):
            raise ExportError(f"tokenizers and transformers decode {ids} differently")


def probe_ids(loaded: models.LoadedModel) -> list[int]:
    """PROBE_TOKENS ids of the probe text (padded with fixed ids if the text is shorter)."""
    ids = models.encode_text(loaded, onnx_manifest.PROBE_TEXT)[: onnx_manifest.PROBE_TOKENS]
    filler = ((7919 * i) % loaded.vocab_size for i in range(1, onnx_manifest.PROBE_TOKENS))
    return (ids + list(filler))[: onnx_manifest.PROBE_TOKENS]


def torch_logits(loaded: models.LoadedModel, prefix: list[int], feed: list[int]) -> torch.Tensor:
    """The torch model's logits [len(feed), V] for ``feed`` after a cached ``prefix``."""
    cache = models.new_cache(loaded)
    if prefix:
        models.forward(loaded, prefix, cache)
    return models.forward(loaded, feed, cache)


def make_manifest(loaded: models.LoadedModel, model_dir: Path, dtype: str, opset: int) -> Manifest:
    """The manifest of an export of ``loaded``, with the torch model's probe logits."""
    shapes = models.kv_shapes(loaded)
    if len({d for _, d in shapes}) != 1:
        raise ExportError(f"per-layer head dims differ ({shapes}): not supported")
    ids = probe_ids(loaded)
    half = len(ids) // 2
    atol, rtol = onnx_manifest.TOLERANCES[dtype]
    reference = torch_logits(loaded, ids[:half], ids[half:])  # [len - half, V]
    probe = Probe(ids[:half], ids[half:], reference.tolist(), atol, rtol)
    versions = {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "onnx": _version("onnx"),
        "onnxruntime": _version("onnxruntime"),
    }
    return Manifest(
        name=loaded.name,
        vocab_size=loaded.vocab_size,
        hidden_size=models.hidden_size(loaded),
        tokenizer_fingerprint=loaded.tokenizer_fingerprint,
        special_tokens=sorted(str(t) for t in loaded.tokenizer.all_special_tokens),
        eos_token_ids=sorted(loaded.eos_token_ids),
        max_positions=loaded.max_positions,
        layers=len(shapes),
        kv_heads=[h for h, _ in shapes],
        head_dim=shapes[0][1],
        dtype=dtype,
        source_hash=onnx_manifest.source_hash(model_dir),
        opset=opset,
        probe=probe,
        exporter=versions,
    )


def check_ragged(backend: OnnxBackend, loaded: models.LoadedModel) -> float:
    """ORT's logits for a ragged batch (rows of different cached and fed lengths, one row with
    no cache) against torch's per sequence; returns the largest difference beyond tolerance."""
    ids = probe_ids(loaded)
    rows = [(0, 3), (2, 1), (5, 2)]  # (cached, fed) per row
    caches = [
        backend.forward([SequenceCache()], [ids[:c]])[0].cache if c else SequenceCache()
        for c, _ in rows
    ]
    feeds = [ids[c : c + f] for c, f in rows]
    outs = backend.forward(caches, feeds)
    atol, rtol = backend.manifest.probe.atol, backend.manifest.probe.rtol
    worst = -float("inf")
    for (c, _), feed, out in zip(rows, feeds, outs, strict=True):
        ref = torch_logits(loaded, ids[:c], feed)
        excess = (out.logits - ref).abs() - (atol + rtol * ref.abs())
        worst = max(worst, float(excess.max()))
    return worst


def export(
    model_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    providers: tuple[str, ...] | None = ("CPUExecutionProvider",),
    opset: int | None = None,
    force: bool = False,
) -> Manifest:
    """Export, check and keep (see the module docstring); ExportError says why not."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise ExportError(f"{out_dir} exists and is not empty (--force replaces it)")
    started = time.perf_counter()
    loaded = models.load_causal_lm(model_dir, "cpu", dtype, lean=False)  # trace transformers
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        manifest = _build(loaded, model_dir, partial, dtype, providers, opset)
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.rename(out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info(
        "exported %s to %s in %.1f s (opset %d, %s, %d layers, vocab %d)",
        model_dir,
        out_dir,
        time.perf_counter() - started,
        manifest.opset,
        dtype,
        manifest.layers,
        manifest.vocab_size,
    )
    return manifest


def _build(
    loaded: models.LoadedModel,
    model_dir: Path,
    out: Path,
    dtype: str,
    providers: tuple[str, ...] | None,
    opset: int | None,
) -> Manifest:
    """Everything of an export into ``out``, checked; raises ExportError on a mismatch."""
    used_opset = export_graph(loaded, out / onnx_manifest.MODEL_FILE, opset)
    save_tokenizer(loaded, out)
    manifest = make_manifest(loaded, model_dir, dtype, used_opset)
    manifest.write(out)
    options = OnnxOptions(providers=providers, threads=torch.get_num_threads())
    try:
        backend = OnnxBackend(out, options)  # re-runs the probe: ORT against torch
    except (BackendError, ManifestError) as exc:
        raise ExportError(f"the exported model failed its check, nothing kept: {exc}") from None
    excess = check_ragged(backend, loaded)
    if excess > 0:
        raise ExportError(
            f"ONNX Runtime's logits on a ragged batch differ from torch's by "
            f"{excess:.3g} beyond tolerance: nothing kept"
        )
    return manifest


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m edge.export``; returns the exit code."""
    logging.basicConfig(
        level=os.environ.get("STARSD_LOG", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("model_dir", help="transformers causal-LM directory (the target model)")
    p.add_argument("out_dir", help="export directory to create")
    p.add_argument("--dtype", default="float32", choices=sorted(onnx_manifest.TOLERANCES))
    p.add_argument(
        "--providers",
        default="cpu",
        type=parse_providers,
        help="providers the self-check runs on, comma-separated (default: cpu)",
    )
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default: torch's)")
    p.add_argument("--threads", type=int, default=1, help="torch and onnxruntime threads")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    args = p.parse_args(argv)
    for noisy in ("onnx_ir", "onnxscript"):  # an INFO line per rewritten initializer
        logging.getLogger(noisy).setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    try:
        export(args.model_dir, args.out_dir, args.dtype, args.providers, args.opset, args.force)
    except (ExportError, ManifestError, BackendError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
