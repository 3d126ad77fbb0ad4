"""The EAGLE proposer (``--draft-kind eagle`` / ``eagle3``): chain drafting from the target's
own features, with an EAGLE-1 head (:mod:`~starsd.hub.drafters.eagle_head`) or an EAGLE-3 one
(:mod:`~starsd.hub.drafters.eagle3_head`).

Per session the hub keeps the committed tokens and the head's KV cache. The cache holds the
``real_pairs`` pairs (f_j, x_{j+1}) fed with the target's features f_j (sent with OPEN and every
DRAFT); the head's chained guesses are drafted in the batch buffer and never kept. The head's
output at the last real pair is its prediction of the feature of the last committed token, whose
draft logits give the first draft token. A batch of jobs feeds every session's new real pairs in
one ragged forward, then chains ``gamma - 1`` batched steps. The two heads differ behind the
same calls: what a feature row holds (the target's last hidden state, or three of its layers
that the head fuses), and what the logits range over (an EAGLE-3 head's own, reduced
vocabulary: drawn in draft ids, proposed and fed back in target ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from starsd.batch import LayerBuffer, RaggedBatch, SequenceCache
from starsd.hub.drafters import eagle3_head, eagle_head
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
    make_proposal,
    new_chain_state,
    propose_batched,
)
from starsd.hub.drafters.tree_draft import TreeBatch
from starsd.protocol import Error, Proposal, SamplingParams
from starsd.tree_shapes import ROOT, TreeShape


@dataclass
class EagleState(ChainState):
    """A session of the EAGLE head: the chain state, the head's cache and its last prediction."""

    cache: SequenceCache = field(default_factory=SequenceCache)  # the real pairs
    real_pairs: int = 0  # cache positions, each fed with the target's own feature
    last_feature: torch.Tensor | None = None  # [H] the head's prediction at the last real pair


@dataclass
class EagleRow(ChainRow[EagleState]):
    """A job in a batch: the real pairs its session feeds before drafting."""

    ids: list[int] = field(default_factory=list)  # x_{j+1} for each new f_j
    features: torch.Tensor | None = None  # [n, W] the new f_j, None when n == 0
    last_feature: torch.Tensor | None = None  # [H] the head's prediction after the feed


class EagleProposer:
    """Drafts with an EAGLE head on the target's embedding (EAGLE-1: and its LM head)."""

    def __init__(
        self, head: eagle_head.LoadedEagle | eagle3_head.LoadedEagle3, max_positions: int | None
    ) -> None:
        self.head = head
        self.kind = head.kind
        self.max_positions = max_positions
        self.feature_width = head.feature_width  # W: one row the target sends
        self.feature_layers = head.feature_layers
        self.vocab = head.vocab
        self.trees = True  # the head's attention takes a token tree's mask

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> EagleState:
        """A session's state; the prompt's features come with its first job."""
        return EagleState(**vars(new_chain_state(prompt, params, gamma)))

    def propose(self, jobs: list[DraftJob[EagleState]]) -> list[Proposal | Error]:
        """Apply each job's verdict and features, then draft every job's proposal in one batch."""
        return propose_batched(jobs, self._prepare, self._draft)

    def _prepare(self, job: DraftJob[EagleState]) -> EagleRow | Proposal | Error:
        state = job.state
        commit_verdict(state, job.accepted, job.appended, job.path)
        n = 0 if job.features is None else len(job.features)
        gamma = fitting_gamma(state, self.max_positions)
        if gamma < 1:
            return context_full(job)
        if n == 0 and state.real_pairs == 0:  # a one-token prompt: nothing to extrapolate yet
            state.proposed = []
            return make_proposal(job, [], [], state.params)
        ids = state.tokens[state.real_pairs + 1 : state.real_pairs + 1 + n]
        if len(ids) != n:  # the table checks the row count; this guards the invariant
            raise ValueError(f"{n} features for {len(ids)} uncached tokens")
        # a copy: the features decoded from the wire are a read-only view of the message
        feats = None if job.features is None else torch.tensor(job.features)
        shape = fitting_tree(state, self.max_positions)
        return EagleRow(job, gamma, vocab=self.vocab, ids=ids, features=feats, shape=shape)

    def _draft(self, rows: list[EagleRow]) -> None:
        caches = [self._draft_group(group, shape) for shape, group in by_shape(rows)]
        for group in caches:  # commit only once every row has drawn
            for row, cache in group:
                _commit(row, cache)

    def _draft_group(
        self, rows: list[EagleRow], shape: TreeShape | None
    ) -> list[tuple[EagleRow, SequenceCache]]:
        if shape is None:
            return self._draft_chain(rows)
        return self._draft_tree(rows, shape)

    def _draft_chain(self, rows: list[EagleRow]) -> list[tuple[EagleRow, SequenceCache]]:
        batch = RaggedBatch(
            tuple(r.state.real_pairs for r in rows),
            tuple(len(r.ids) for r in rows),
            max(r.gamma for r in rows) - 1,
        )
        buffer = batch.gather(
            [r.state.cache for r in rows], self.head.kv_shapes, self.head.dtype, self.head.device
        )[0]
        feature = self._feed(batch, rows, buffer)  # [B, H]
        filled = batch.cached_width + batch.fed_width
        for step in range(batch.steps + 1):
            fed = draw_step(self.head.logits(feature), rows, step, self.vocab)  # [B]
            if self.vocab is not None:  # drawn in draft ids, embedded in target ids
                fed = self.vocab.to_target(fed)
            if step < batch.steps:
                feature = self.head.forward_batch(
                    fed[:, None],
                    feature[:, None],
                    batch.step_positions(step),
                    batch.mask(filled + step + 1),
                    buffer,
                )[:, 0]  # [B, H]
        # the chained guesses are not kept
        return [(row, batch.scatter([buffer], i, 0)) for i, row in enumerate(rows)]

    def _draft_tree(
        self, rows: list[EagleRow], shape: TreeShape
    ) -> list[tuple[EagleRow, SequenceCache]]:
        """Grow every row's token tree (:mod:`~starsd.hub.drafters.tree_draft`): the real pairs,
        then one forward per depth over the expanded nodes, each fed with its parent's
        predicted feature (the root's: the prediction at the last real pair)."""
        batch = RaggedBatch(
            tuple(r.state.real_pairs for r in rows),
            tuple(len(r.ids) for r in rows),
            shape.fed_columns,
        )
        buffer = batch.gather(
            [r.state.cache for r in rows], self.head.kv_shapes, self.head.dtype, self.head.device
        )[0]
        root = self._feed(batch, rows, buffer)  # [B, H]
        filled = batch.cached_width + batch.fed_width
        committed = batch.key_mask(filled).bool() if batch.padded else None
        trees = TreeBatch([r.new_tree() for r in rows], shape, filled, committed, self.vocab)
        predicted = [{ROOT: root[i]} for i in range(batch.rows)]  # node -> its prediction
        root_position = batch.step_positions(0) - 1  # [B, 1]
        logits, depth = self.head.logits(root)[:, None], 1  # [B, 1, K]
        while trees.grow(logits, depth):
            ids, fed, depths, allowed = trees.feed()  # [B, w] each, mask [B, w, T]
            parents = self._parent_features(trees, fed, predicted, root)  # [B, w, H]
            out = self.head.forward_batch(ids, parents, root_position + depths, allowed, buffer)
            for i, nodes in enumerate(fed):
                predicted[i].update((node, out[i, j]) for j, node in enumerate(nodes))
            logits, depth = self.head.logits(out), depth + 1  # [B, w, K]
        trees.finish()
        for row, grown in zip(rows, trees.trees, strict=True):
            row.grown = grown
        return [(row, batch.scatter([buffer], i, 0)) for i, row in enumerate(rows)]

    def _parent_features(
        self,
        trees: TreeBatch,
        fed: list[list[int]],
        predicted: list[dict[int, torch.Tensor]],
        root: torch.Tensor,
    ) -> torch.Tensor:
        """[B, w, H] the prediction at each fed node's parent (zeros at padding)."""
        out = root.new_zeros(len(fed), trees.shape.width, root.shape[-1])
        for i, nodes in enumerate(fed):
            for j, node in enumerate(nodes):
                out[i, j] = predicted[i][trees.trees[i].parents[node]]
        return out

    def _feed(self, batch: RaggedBatch, rows: list[EagleRow], buffer: LayerBuffer) -> torch.Tensor:
        """Feed every row's new real pairs; the head's prediction at each row's last one [B, H]."""
        predicted = [r.state.last_feature for r in rows]
        if batch.fed_width:
            feats = torch.zeros(
                batch.rows, batch.fed_width, self.feature_width, dtype=self.head.dtype
            )  # [B, F, H]
            for i, row in enumerate(rows):
                if row.features is not None:
                    feats[i, : len(row.ids)] = row.features
            out = self.head.forward_batch(
                batch.input_ids([r.ids for r in rows]),
                feats,
                batch.feed_positions(),
                batch.mask(batch.cached_width + batch.fed_width),
                buffer,
            )  # [B, F, H]
            for i, row in enumerate(rows):
                if row.ids:
                    predicted[i] = out[i, len(row.ids) - 1]
        for row, feature in zip(rows, predicted, strict=True):
            row.last_feature = feature
        return torch.stack(predicted)  # type: ignore[arg-type]  # (every row has one now)


def _commit(row: EagleRow, cache: SequenceCache) -> None:
    """The session keeps its real pairs and the prediction at the last one."""
    row.state.cache = cache
    row.state.real_pairs = cache.length
    row.state.last_feature = row.last_feature
