"""What a target needs from a model runtime (p side), whatever runs the forward.

A backend runs one ragged batch: row i holds a sequence's KV cache (``c_i`` positions) and feeds
``f_i`` new tokens after it, so verification of B sequences, each ``[last, d_1 .. d_gamma]``, and
B standalone steps (``[last]`` each) are one call. The caches are
:class:`starsd.batch.SequenceCache` (the same ragged-batch code the hub drafts with): a backend
returns each row's cache extended by its fed positions, and rolling a sequence back to its
accepted length is ``cache.crop(n)``.

Backends: ``torch`` (transformers, CPU and CUDA; the default) and ``onnxruntime`` (an exported
decoder run by ONNX Runtime, TensorRT -> CUDA -> CPU providers; no transformers needed).
This module imports neither transformers nor onnxruntime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from starsd.batch import SequenceCache
from starsd.tree import TreeFeed


@dataclass(frozen=True)
class ModelInfo:
    """What the handshake and the stop rules need to know of the target model."""

    name: str
    vocab_size: int  # width of the logits
    hidden_size: int  # width of the features an EAGLE hub drafts from
    tokenizer_fingerprint: str  # equal iff token ids mean the same text (HELLO checks it)
    eos_token_ids: frozenset[int]
    max_positions: int | None
    # L when every hidden state 0..L can be tapped (starsd.llama.tapped: EAGLE-3's layers);
    # 0 when only the last one (-1) can
    layers: int = 0
    # whether the backend's forward verifies token trees (``forward(trees=)``: an attention
    # that takes a mask per row); False: chains only, and HELLO announces no trees
    supports_trees: bool = False


@dataclass
class RowOutput:
    """One row's result of a ragged forward."""

    logits: torch.Tensor  # [f_i, V] float32: the distribution after each fed token
    features: torch.Tensor | None  # [f_i, len(taps) H] the taps asked for, else None
    cache: SequenceCache  # the row's cache extended by its f_i fed positions (a new object)


class VerifierBackend(Protocol):
    """A target model runtime: tokenizer plus ragged, cached forwards."""

    info: ModelInfo

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt (the tokenizer's own special-token convention)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens dropped."""
        ...

    def forward(
        self,
        caches: Sequence[SequenceCache],
        feeds: Sequence[Sequence[int]],
        taps: Sequence[int] = (),
        trees: Sequence[TreeFeed | None] | None = None,
    ) -> list[RowOutput]:
        """One forward of every row: ``feeds[i]`` (at least one token) after ``caches[i]``;
        with ``taps``, each row's hidden states there too (:func:`starsd.llama.tapped`).
        ``trees[i]`` lays row i out as a token tree (:class:`starsd.tree.TreeFeed`: its nodes
        see their ancestors only, each at its depth's position); a backend that cannot raises
        ValueError.

        The input caches are left as they are (a row's result may share their storage only
        read-only); rows are independent: a row's logits do not depend on the others in the
        batch beyond float rounding of the batched kernels.
        """
        ...
