"""The draft-LLM proposer (``--draft-kind llm``): chain drafting with a separate small causal LM.

Each session keeps its own KV cache (a :class:`~starsd.batch.SequenceCache`) next to the
committed tokens; a verdict crops the cache back to what stays valid (the accepted prefix). A
batch of jobs is drafted together: every session's uncached tokens go through one ragged
forward, then ``gamma - 1`` batched decode steps, each row drawing with its own generator.

A draft may predict over a reduced vocabulary (:class:`~starsd.hub.drafters.vocab.DraftVocab`,
``draft_vocab.safetensors`` in its directory): its model then has K + 1 token rows, the K draft
tokens and one row for every target token outside them (input only: never drafted). Sessions,
proposals and q stay in target ids; only the model's inputs and logits are in draft ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from starsd import models
from starsd.batch import LayerBuffer, RaggedBatch, SequenceCache
from starsd.hub.drafters.base import (
    ChainRow,
    ChainState,
    DraftJob,
    by_shape,
    commit_verdict,
    context_full,
    draw_step,
    fitting_gamma,
    fitting_tree,
    new_chain_state,
    propose_batched,
)
from starsd.hub.drafters.tree_draft import TreeBatch
from starsd.hub.drafters.vocab import DraftVocab
from starsd.llama import PaddedKeyValues
from starsd.protocol import Error, Proposal, SamplingParams
from starsd.tree_shapes import TreeShape


@dataclass
class LlmState(ChainState):
    """A session of the draft LLM: the shared chain state plus its KV cache."""

    cache: SequenceCache = field(default_factory=SequenceCache)  # committed (+ drafted) positions
    # the draft's top tokens at each position of the last proposal (pre-drafting's branches)
    alternatives: list[tuple[list[int], list[float]]] = field(default_factory=list)


@dataclass
class LlmRow(ChainRow[LlmState]):
    """A job in a batch (or a pre-draft branch): the cache it drafts on and what it feeds."""

    feed: list[int] = field(default_factory=list)
    source: SequenceCache = field(default_factory=SequenceCache)  # the cached prefix
    whole: bool = True  # result holds source + new positions; False: the new positions only
    cache: SequenceCache | None = None  # the result, once drafted


class LlmProposer:
    """Chain drafting with a small causal LM (q), every job of a batch in one forward."""

    kind = "llm"
    feature_width = 0
    feature_layers: tuple[int, ...] = ()

    def __init__(self, draft: models.LoadedModel, vocab: DraftVocab | None = None) -> None:
        self.draft = draft
        self.vocab = vocab  # None: the draft predicts over the target's own vocabulary
        self.max_positions = draft.max_positions
        self.kv_shapes = models.kv_shapes(draft)  # (heads, head_dim) per layer
        self.dtype = next(draft.model.parameters()).dtype
        self.record_alternatives = False  # set by the pre-drafter that reads them
        self.trees = True  # token trees: a tree mask in StarSD's attention or transformers

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> LlmState:
        """A session's state with an empty cache; the prompt is fed with its first job."""
        return LlmState(**vars(new_chain_state(prompt, params, gamma)))

    def propose(self, jobs: list[DraftJob[LlmState]]) -> list[Proposal | Error]:
        """Apply each job's verdict, then draft every job's next proposal in one batch."""
        return propose_batched(jobs, self._prepare, self._draft)

    def _prepare(self, job: DraftJob[LlmState]) -> LlmRow | Error:
        feed = apply_verdict(job.state, job.accepted, job.appended, job.path)
        gamma = fitting_gamma(job.state, self.max_positions)
        if gamma < 1:
            return context_full(job)
        shape = fitting_tree(job.state, self.max_positions) if self.trees else None
        alternatives: list[tuple[list[int], list[float]]] | None = (
            [] if self.record_alternatives and shape is None else None
        )
        return LlmRow(
            job,
            gamma,
            feed=feed,
            source=job.state.cache,
            alternatives=alternatives,
            vocab=self.vocab,
            shape=shape,
        )

    def _draft(self, rows: list[LlmRow]) -> None:
        for shape, group in by_shape(rows):
            if shape is None:
                for _ in self.draft_steps(group):
                    pass
            else:
                self._draft_tree(group, shape)
        for row in rows:  # commit only once every row has drawn
            assert row.cache is not None
            row.state.cache = row.cache
            row.state.alternatives = row.alternatives or []

    def draft_steps(self, rows: list[LlmRow]) -> Iterator[None]:
        """Draft ``rows`` together, pausing after each forward (pre-drafting runs one forward at
        a time between real jobs). Fills each row's tokens and ``cache``; commits nothing."""
        batch, buffers, logits = self._feed(rows, max(r.gamma for r in rows) - 1)
        filled = batch.cached_width + batch.fed_width
        for step in range(batch.steps + 1):
            fed = draw_step(logits, rows, step, self.vocab)  # [B] draft ids
            if step < batch.steps:
                yield
                logits = self._step(batch, buffers, fed, step, filled)  # [B, V]
        for i, row in enumerate(rows):
            row.cache = batch.scatter(buffers, i, row.gamma - 1, keep_cached=row.whole)

    def _feed(
        self, rows: list[LlmRow], steps: int
    ) -> tuple[RaggedBatch, list[LayerBuffer], torch.Tensor]:
        """Gather the rows' caches into buffers with room for ``steps`` more columns and feed
        their uncached tokens: the batch, its buffers and the logits [B, K] after each row's
        last fed token (its first draft position)."""
        batch = RaggedBatch(
            tuple(r.source.length for r in rows), tuple(len(r.feed) for r in rows), steps
        )
        buffers = batch.gather(
            [r.source for r in rows], self.kv_shapes, self.dtype, self.draft.device
        )
        filled = batch.cached_width + batch.fed_width
        ids = self._ids(batch.input_ids([r.feed for r in rows]))  # [B, F]
        logits, _ = models.forward_batch(
            self.draft, ids, batch.feed_positions(), PaddedKeyValues(buffers, batch.mask(filled))
        )
        return batch, buffers, self._drafted(logits[torch.arange(batch.rows), batch.last_fed()])

    def _draft_tree(self, rows: list[LlmRow], shape: TreeShape) -> None:
        """Grow every row's token tree (:mod:`~starsd.hub.drafters.tree_draft`): the committed
        feed, then one forward per depth over the expanded nodes. Each row's cache keeps its
        committed positions only (the tree's keys are dropped with the buffer)."""
        batch, buffers, root = self._feed(rows, shape.fed_columns)  # root: [B, K]
        filled = batch.cached_width + batch.fed_width
        committed = batch.key_mask(filled).bool() if batch.padded else None
        trees = TreeBatch([r.new_tree() for r in rows], shape, filled, committed, self.vocab)
        root_position = batch.step_positions(0) - 1  # [B, 1]
        logits, depth = root[:, None], 1  # [B, 1, K]
        while trees.grow(logits, depth):
            ids, _, depths, allowed = trees.feed()  # [B, w] each, mask [B, w, T]
            logits = self._drafted(
                models.forward_batch(
                    self.draft,
                    self._ids(ids),
                    root_position + depths,
                    PaddedKeyValues(buffers, allowed),
                )[0]
            )  # [B, w, K]
            depth += 1
        trees.finish()
        for i, (row, grown) in enumerate(zip(rows, trees.trees, strict=True)):
            row.grown = grown
            row.cache = batch.scatter(buffers, i, 0, keep_cached=row.whole)

    def next_logits(self, caches: list[SequenceCache], tokens: list[int]) -> torch.Tensor:
        """The draft's logits [B, V] after feeding one token on each cache (nothing kept)."""
        batch = RaggedBatch(tuple(c.length for c in caches), (1,) * len(caches), 0)
        buffers = batch.gather(caches, self.kv_shapes, self.dtype, self.draft.device)
        ids = self._ids(batch.input_ids([[t] for t in tokens]))  # [B, 1]
        logits, _ = models.forward_batch(
            self.draft,
            ids,
            batch.feed_positions(),
            PaddedKeyValues(buffers, batch.mask(batch.capacity)),
        )
        return self._drafted(logits[:, 0])

    def _step(
        self, batch: RaggedBatch, buffers: list, fed: torch.Tensor, step: int, filled: int
    ) -> torch.Tensor:
        """One decode step of every row; logits [B, V]."""
        positions = batch.step_positions(step)  # [B, 1]
        if self.max_positions is not None:  # rows already complete may run past their limit
            positions = positions.clamp(max=self.max_positions - 1)
        logits, _ = models.forward_batch(
            self.draft,
            fed[:, None],
            positions,
            PaddedKeyValues(buffers, batch.mask(filled + step + 1)),
        )
        return self._drafted(logits[:, 0])

    def _ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """The model's input ids for committed target ids (the unknown row outside the draft's
        vocabulary)."""
        if self.vocab is None:
            return target_ids
        return self.vocab.to_draft(target_ids, unknown=self.vocab.size)

    def _drafted(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over what may be drafted [B, V or K] (never the unknown row)."""
        return logits if self.vocab is None else logits[..., : self.vocab.size]


def apply_verdict(
    state: LlmState,
    accepted: int,
    appended: tuple[int, ...],
    path: tuple[int, ...] | None = None,
) -> list[int]:
    """Commit the verdict (``path``: after a token tree) and crop the cache to what stays valid.

    Returns the tokens to feed next: those committed but not cached (at least the last one,
    whose logits give the first draft token). After a tree the cache holds committed positions
    only, so it stays valid whole.
    """
    valid = min(state.cache.length, len(state.tokens) + accepted)
    commit_verdict(state, accepted, appended, path)
    valid = min(valid, len(state.tokens) - 1)
    state.cache.crop(valid)
    return state.tokens[valid:]
