"""The ``torch`` verifier backend: a transformers causal LM, CPU or CUDA (the default backend).

Two ways to run a ragged batch:

* pooled (a plain Llama, which runs :mod:`starsd.llama`): every sequence's cache is a slot of
  one :class:`~starsd.kvpool.KVPool`; a forward writes the rows' new keys in place and attends
  over their slots, one attention per layer, with no copies of whole caches
  (:class:`~starsd.kvpool.PooledRows`);
* gather (any other architecture, which keeps transformers' forward and attention): copy the
  rows' caches into one padded batch (:class:`~starsd.batch.RaggedBatch`, the code the hub
  drafts with), run :func:`starsd.models.forward_batch` once, scatter every row's cache back
  out. The feed is padded on the right (batch.py explains why: a padding query that saw no key
  would turn into NaN and poison the real rows). A token tree's row goes in with the whole
  mask (:meth:`~starsd.batch.RaggedBatch.tree_mask`), which transformers takes as a 4D mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from edge.backends.base import ModelInfo, RowOutput
from starsd import models
from starsd.batch import RaggedBatch, SequenceCache
from starsd.kvpool import KVPool, PooledRows
from starsd.llama import PaddedKeyValues
from starsd.tree import TreeFeed


class TorchBackend:
    """A :class:`~edge.backends.base.VerifierBackend` over a loaded transformers model (p)."""

    name = "torch"

    def __init__(self, loaded: models.LoadedModel) -> None:
        self.loaded = loaded
        # Caches in one pool where the model's attention is ours (starsd.llama): no gather /
        # scatter copies. Elsewhere the padded batch. Token trees on both (a mask per row;
        # transformers' attention takes it as a 4D mask).
        pooled = loaded.decoder is not None
        self.info = ModelInfo(
            loaded.name,
            loaded.vocab_size,
            models.hidden_size(loaded),
            loaded.tokenizer_fingerprint,
            loaded.eos_token_ids,
            loaded.max_positions,
            models.layer_count(loaded),
            supports_trees=True,
        )
        self.kv_shapes = models.kv_shapes(loaded)  # (kv heads, head dim) per layer
        self.dtype = next(loaded.model.parameters()).dtype
        heads, dim = self.kv_shapes[0]
        self.cache_shape = (len(self.kv_shapes), heads, dim)
        self.pool = KVPool(self.cache_shape, self.dtype, loaded.device) if pooled else None

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        forward: str = "auto",
    ) -> TorchBackend:
        """Load ``model_dir`` (a transformers causal-LM directory) for verification; ``forward``
        "transformers" keeps transformers' own forward even for a plain Llama."""
        if forward not in models.FORWARDS:
            raise ValueError(f"forward must be one of {models.FORWARDS}, got {forward!r}")
        return cls(models.load_causal_lm(model_dir, device, dtype, lean=forward == "auto"))

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt (the tokenizer's own special-token convention)."""
        return models.encode_text(self.loaded, text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens dropped."""
        return models.decode_ids(self.loaded, list(ids))

    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (the HTTP server's chat route)."""
        return models.has_chat_template(self.loaded)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template (ValueError: none, or the
        template refuses them)."""
        return models.chat_prompt_ids(self.loaded, messages)

    def forward(
        self,
        caches: Sequence[SequenceCache],
        feeds: Sequence[Sequence[int]],
        taps: Sequence[int] = (),
        trees: Sequence[TreeFeed | None] | None = None,
    ) -> list[RowOutput]:
        """One padded forward of every row; see :meth:`VerifierBackend.forward`."""
        if self.pool is not None:
            return self._forward_pooled(self.pool, caches, feeds, taps, trees)
        batch = RaggedBatch(tuple(c.length for c in caches), tuple(len(f) for f in feeds), 0)
        buffers = batch.gather(caches, self.kv_shapes, self.dtype, self.loaded.device)
        positions, mask = batch.feed_positions(), batch.mask(batch.capacity)
        if trees is not None and any(t is not None for t in trees):
            mask = batch.tree_mask([None if t is None else t.mask() for t in trees])
            _tree_positions(positions, batch.cached, trees)
        logits, hidden = models.forward_batch(
            self.loaded,
            batch.input_ids(feeds),
            positions,
            PaddedKeyValues(buffers, mask),
            taps,
            fed=batch.fed,
        )  # [B, F, V], [B, F, len(taps) H] or None
        return [
            RowOutput(logits[row, :fed], _rows(hidden, row, fed), batch.scatter(buffers, row, 0))
            for row, fed in enumerate(batch.fed)
        ]

    def _forward_pooled(
        self,
        pool: KVPool,
        caches: Sequence[SequenceCache],
        feeds: Sequence[Sequence[int]],
        taps: Sequence[int],
        trees: Sequence[TreeFeed | None] | None = None,
    ) -> list[RowOutput]:
        """Every row in its pool slot: the new positions are written after its cached ones (so
        the input caches' positions stay as they are); a tree row's nodes at their depths."""
        fed = tuple(len(f) for f in feeds)
        trees = trees or [None] * len(feeds)
        masks = [None if t is None else t.mask() for t in trees]
        rows = PooledRows(pool, caches, fed, masks)
        layout = RaggedBatch(rows.start, fed, 0)  # for the padded ids and the positions
        positions = layout.feed_positions()
        _tree_positions(positions, rows.start, trees)
        logits, hidden = models.forward_batch(
            self.loaded, layout.input_ids(feeds), positions, rows, taps, fed=fed
        )
        return [
            RowOutput(logits[row, :f], _rows(hidden, row, f), rows.result(row))
            for row, f in enumerate(fed)
        ]

    def close(self) -> None:
        """Nothing to release beyond what the garbage collector frees."""


def _tree_positions(
    positions: torch.Tensor, cached: Sequence[int], trees: Sequence[TreeFeed | None]
) -> None:
    """Put each tree row's nodes [B, F] at their depths' positions (after its ``cached``)."""
    for row, t in enumerate(trees):
        if t is not None:
            offsets = t.offsets()
            positions[row, : len(offsets)] = cached[row] + torch.tensor(offsets)


def _rows(hidden: torch.Tensor | None, row: int, fed: int) -> torch.Tensor | None:
    """Row ``row``'s first ``fed`` feature rows [fed, len(taps) H] (None when not asked for)."""
    return None if hidden is None else hidden[row, :fed]


def load(
    model_dir: str | Path, device: str = "cpu", dtype: str = "float32", forward: str = "auto"
) -> TorchBackend:
    """The factory's entry point (see :func:`edge.backends.load_backend`)."""
    return TorchBackend.load(model_dir, device, dtype, forward)
