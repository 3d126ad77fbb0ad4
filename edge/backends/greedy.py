"""Greedy decoding straight over a backend: no sampler, no hub, no batcher.

What checks of a backend's exactness compare with transformers' ``generate()`` (the export
tests, the ONNX Runtime benchmark, ``scripts.bench.check_gpu_backends``); a target decodes through
:mod:`edge.verifier` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge.backends.base import VerifierBackend
from starsd.batch import SequenceCache


def greedy(backend: VerifierBackend, prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    """Up to ``n`` greedy tokens per prompt (stopping after an EOS), every prompt at once: one
    ragged forward per step, the prompts fed whole first (rows start at different lengths)."""
    caches = [SequenceCache() for _ in prompts]
    feeds = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    active = [i for i in range(len(prompts)) if n > 0]
    while active:
        rows = backend.forward([caches[i] for i in active], [feeds[i] for i in active])
        for i, row in zip(list(active), rows, strict=True):
            token = int(row.logits[-1].argmax())
            out[i].append(token)
            caches[i], feeds[i] = row.cache, [token]
            if token in backend.info.eos_token_ids or len(out[i]) >= n:
                active.remove(i)
    return out
