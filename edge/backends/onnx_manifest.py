"""What ``python -m edge.export`` writes next to ``model.onnx``, and how a target checks it.

An export directory holds ``model.onnx`` (one decoder with explicit KV cache inputs and outputs),
``manifest.json`` (this module's :class:`Manifest`) and the tokenizer files. The manifest carries
everything the ONNX Runtime backend would otherwise need transformers for: the handshake fields
(vocabulary, tokenizer fingerprint, EOS ids, position limit), the cache shapes, a hash of the
source model, and a probe (token ids plus the torch model's logits for them) that a target re-runs
at start to refuse an export that drifted from the model it came from.

No torch, transformers or onnxruntime here (the exporter and the backend share it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
# The probe: prefill PROBE_TEXT's first half, then feed the second half after the cached first
# (so the check goes through the KV cache path a verifier uses, not only a prefill).
PROBE_TEXT = "To be, or not to be: that is the question. The winter of our discontent"
PROBE_TOKENS = 8
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (2e-2, 2e-2)}  # (atol, rtol) on logits


class ManifestError(ValueError):
    """An export directory that cannot be used: missing, malformed, or not the expected model."""


def input_names(layers: int) -> list[str]:
    """The decoder's inputs, in order."""
    past = [f"past.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return ["input_ids", "position_ids", "attention_mask", *past]


def output_names(layers: int) -> list[str]:
    """The decoder's outputs, in order."""
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return ["logits", "hidden", *present]


@dataclass(frozen=True)
class Probe:
    """Token ids fed in two forwards, and the torch model's logits of the second forward."""

    first: list[int]  # prefilled into an empty cache
    second: list[int]  # fed after ``first``
    logits: list[list[float]]  # [len(second), V] float32, from torch at export time
    atol: float
    rtol: float

    def drift(self, logits: Any) -> float:
        """How far ``logits`` ([len(second), V], like :attr:`logits`) are beyond tolerance:
        max over entries of |got - ref| - (atol + rtol * |ref|); <= 0 is within."""
        got = np.asarray(logits, dtype=np.float64)
        ref = np.asarray(self.logits, dtype=np.float64)
        if got.shape != ref.shape:
            raise ValueError(f"probe logits of shape {got.shape}, expected {ref.shape}")
        return float((np.abs(got - ref) - (self.atol + self.rtol * np.abs(ref))).max())


@dataclass(frozen=True)
class Manifest:
    """The contents of ``manifest.json`` (see the module docstring)."""

    name: str
    vocab_size: int
    hidden_size: int
    tokenizer_fingerprint: str
    special_tokens: list[str]
    eos_token_ids: list[int]
    max_positions: int | None
    layers: int
    kv_heads: list[int]  # per layer
    head_dim: int
    dtype: str  # float32 | float16
    source_hash: str  # sha256 of config.json and the weight files
    opset: int
    probe: Probe
    format: int = FORMAT_VERSION
    exporter: dict[str, str] = field(default_factory=dict)  # library versions, for the record

    def write(self, directory: Path) -> None:
        """Write ``manifest.json`` into ``directory``."""
        data = asdict(self)
        # Readable fields one per line; the probe's logits on one line (thousands of numbers).
        text = json.dumps({**data, "probe": "@probe"}, indent=1)
        text = text.replace('"@probe"', json.dumps(data["probe"]))
        (directory / MANIFEST_FILE).write_text(text + "\n")

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """Read and check ``directory/manifest.json``; ManifestError says what is wrong."""
        path = Path(directory) / MANIFEST_FILE
        if not path.is_file():
            raise ManifestError(
                f"{directory} is not an export directory: no {MANIFEST_FILE} "
                "(python -m edge.export MODEL_DIR OUT_DIR makes one)"
            )
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT_VERSION:
                raise ManifestError(
                    f"{path}: format {raw.get('format')!r}, this build reads "
                    f"{FORMAT_VERSION}: re-export the model"
                )
            manifest = cls(**{**raw, "probe": Probe(**raw["probe"])})
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"{path} is malformed: {exc}") from None
        manifest.check_shapes()
        return manifest

    def check_shapes(self) -> None:
        """Cross-field consistency (a hand-edited or truncated manifest is refused here)."""
        if len(self.kv_heads) != self.layers or self.layers < 1:
            raise ManifestError(f"manifest: {self.layers} layers but kv heads {self.kv_heads}")
        if self.dtype not in TOLERANCES:
            raise ManifestError(f"manifest: dtype {self.dtype!r}, not one of {sorted(TOLERANCES)}")
        bad = [t for t in self.probe.first + self.probe.second if not 0 <= t < self.vocab_size]
        if bad or any(len(row) != self.vocab_size for row in self.probe.logits):
            raise ManifestError(f"manifest: the probe does not fit vocab {self.vocab_size}")


def source_hash(model_dir: Path) -> str:
    """sha256 of a model directory's config and weights (names and bytes, sorted by name)."""
    files = sorted(
        p
        for p in Path(model_dir).iterdir()
        if p.name == "config.json" or p.suffix in (".safetensors", ".bin")
    )
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
