"""Verifier backends: the model runtimes a target verifies with (see :mod:`edge.backends.base`).

:func:`load_backend` imports the chosen backend's module only when asked for, so that a target
running ``onnxruntime`` never imports transformers (the ``torch`` backend's module does). Each
backend module exposes ``load(model_dir, device, dtype, **options) -> VerifierBackend``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from edge.backends.base import VerifierBackend

BACKENDS = ("torch", "onnxruntime")  # --backend choices; the first is the default


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot be loaded here (not built, or its runtime not installed)."""


def load_backend(
    name: str, model_dir: str | Path, device: str = "cpu", dtype: str = "float32", **options: Any
) -> VerifierBackend:
    """Import backend ``name``'s module and load ``model_dir`` with it.

    Raises:
        ValueError: for a name not in :data:`BACKENDS`.
        BackendUnavailable: when the backend's module or its runtime cannot be imported.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    try:
        module = importlib.import_module(f"edge.backends.{name}")
    except ImportError as exc:  # the module itself, or a runtime it needs (onnxruntime, ...)
        raise BackendUnavailable(f"the {name} backend is not available here: {exc}") from exc
    loader = getattr(module, "load", None)
    if loader is None:
        raise BackendUnavailable(f"edge.backends.{name} has no load(model_dir, device, dtype)")
    backend: VerifierBackend = loader(model_dir, device, dtype, **options)
    return backend
