"""Target-side state of sequences (p side): batched verification, commit, KV rollback, stopping.

Invariant: a sequence's KV cache holds every committed token except the last one, ``last``, whose
logits are computed by the next forward. Verification therefore feeds ``[last, d_1 .. d_gamma]``
and reads gamma + 1 distributions; a standalone step feeds ``[last]``. Sequences never call the
model themselves: :func:`prefill_batch`, :func:`step_batch` and :func:`verify_batch` run ONE
backend forward for all their rows, then judge each row with its own generator
(:mod:`starsd.sampling`, the one implementation of the lossless math), so a row's result does not
depend on its batch mates. The result equals verifying each sequence alone (greedy: token for
token, up to float rounding of the batched kernels).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edge.backends.base import ModelInfo, RowOutput, VerifierBackend
from starsd import limits, sampling, tree
from starsd.batch import SequenceCache
from starsd.protocol import SamplingParams
from starsd.stats import latency_summary

VerifyRow = tuple["TargetSequence", Sequence[int], "torch.Tensor | None"]  # (seq, drafts, q [g, V])
# A token tree's parents per row (starsd.tree; None: the drafts are a chain). For a sampled tree,
# q's row i is the law node i was drawn from: its parent's q (siblings carry the same row).
Parents = Sequence[int] | None
MAX_TREE_NODES = 64  # the most nodes a proposal's tree may hold


def announced_tree_nodes(info: ModelInfo) -> int:
    """The tree nodes a target running ``info``'s backend announces in HELLO (0: chains only).
    At most the wire's ``limits.MAX_TREE_NODES``: a target's frame limit holds dense q for that
    many rows (limits.target_max_frame_bytes), so a larger tree could not reach it."""
    return min(MAX_TREE_NODES, limits.MAX_TREE_NODES) if info.supports_trees else 0


@dataclass
class SequenceStats:
    """What the JSONL output reports per sequence."""

    rounds: int = 0
    accepted: int = 0
    proposed: int = 0
    target_forwards: int = 0
    # the batched forwards that carried it and their seconds (the batcher's, on the event loop)
    forwards: int = 0
    forward_s: float = 0.0
    standalone_steps: int = 0  # tokens decoded without the hub (fallback)
    alone_steps: int = 0  # tokens decoded alone because the hub asked (gamma 0)
    moves: int = 0  # times it resumed speculating on another hub after its hub was lost
    resume_s: float = 0.0  # longest: hub loss detected -> first proposal verified on the next
    standalone_at_resume: int = 0  # standalone_steps when it last resumed
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0
    last_commit: float = field(default_factory=time.perf_counter)
    token_latency_s: list[float] = field(default_factory=list)  # per token: its round / tokens

    def record_commit(self, tokens: int) -> None:
        now = time.perf_counter()
        self.token_latency_s.extend([(now - self.last_commit) / tokens] * tokens)
        self.last_commit = now

    def as_dict(self, generated: int) -> dict[str, Any]:
        wall = max((self.finished or time.perf_counter()) - self.started, 1e-9)
        latency = latency_summary(self.token_latency_s)
        return {
            "rounds": self.rounds,
            "accepted": self.accepted,
            "mean_accepted": round(self.accepted / self.rounds, 4) if self.rounds else 0.0,
            "standalone_steps": self.standalone_steps,
            "alone_steps": self.alone_steps,
            "moves": self.moves,
            "resume_s": round(self.resume_s, 4),
            # standalone steps after speculation resumed on another hub (0: none past detection)
            "standalone_after_move": self.standalone_steps - self.standalone_at_resume
            if self.moves
            else 0,
            "tokens_per_s": round(generated / wall, 3),
            "latency_ms": {k: round(v, 4) for k, v in latency.items()},
        }


class TargetSequence:
    """One sequence on the target: committed tokens, KV cache, sampler, stop conditions."""

    def __init__(
        self,
        backend: VerifierBackend,
        prompt: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        taps: Sequence[int] = (),
        prefill: bool = True,
    ) -> None:
        """``prefill`` False leaves the prompt unfed: batch it later with :func:`prefill_batch`
        (a step or verify before that feeds it too, but an EAGLE hub needs its features first)."""
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        self.backend = backend
        self.info: ModelInfo = backend.info
        self.prompt = list(prompt)
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.generator = sampling.make_generator(params.seed)
        self.generated: list[int] = []
        self.done = max_new_tokens <= 0
        self.stats = SequenceStats()
        self.cache: SequenceCache | None = SequenceCache()  # None once the sequence is done
        # EAGLE hubs draft from the target's features: the hidden states at ``taps``
        # (starsd.llama.tapped; () none), one row per committed position but the last (whose
        # forward has not run yet), kept in float16 for the wire.
        self.taps = tuple(taps)
        self.feature_rows: list[torch.Tensor] = []  # each [len(taps) H] float16
        # Called (in whichever thread commits) with each run of newly committed tokens: the
        # HTTP server (edge.serve) streams them as they land. None: nobody listens.
        self.on_commit: Callable[[list[int]], None] | None = None
        if prefill:
            prefill_batch(backend, [self])

    @property
    def last(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def committed(self) -> int:
        """Number of committed tokens (prompt + generated)."""
        return len(self.prompt) + len(self.generated)

    @property
    def cached(self) -> int:
        """Positions in the KV cache (``committed - 1`` once prefilled)."""
        return self.cache.length if self.cache is not None else 0

    def uncached(self) -> list[int]:
        """Committed tokens not in the cache yet (``[last]`` once prefilled)."""
        return [*self.prompt, *self.generated][self.cached :]

    def step(self) -> int:
        """Standalone decoding of this sequence alone: one forward, one token (the baseline)."""
        return step_batch(self.backend, [self])[0]

    def verify(
        self, draft_tokens: list[int], q_probs: torch.Tensor | None, parents: Parents = None
    ) -> tuple[int, list[int]]:
        """Verify one proposal alone (``parents``: a token tree); see :func:`verify_batch`."""
        return verify_batch(self.backend, [(self, draft_tokens, q_probs)], [parents])[0]

    @property
    def collect_features(self) -> bool:
        """Whether this sequence keeps features (some taps)."""
        return bool(self.taps)

    def features(self, start: int, stop: int, taps: Sequence[int] | None = None) -> np.ndarray:
        """Features of positions ``start .. stop - 1`` at ``taps`` (a subset of the sequence's
        own; None: all of them) as [n, len(taps) H] float16."""
        taps = self.taps if taps is None else tuple(taps)
        rows = self.feature_rows[start:stop]
        if len(rows) != stop - start:
            raise ValueError(f"features {start}..{stop} not available ({len(self.feature_rows)})")
        if not rows:
            return np.zeros((0, len(taps) * self.info.hidden_size), dtype=np.float16)
        return tap_columns(torch.stack(rows), self.taps, taps, self.info.hidden_size).numpy()

    def _apply(
        self,
        drafts: Sequence[int],
        q_probs: torch.Tensor | None,
        out: RowOutput,
        fed_before: int,
        is_round: bool,
        taps: tuple[int, ...] = (),
        parents: Parents = None,
    ) -> tuple[int, list[int]]:
        """Judge a forward's row (``fed_before`` uncached tokens, then ``drafts``: a chain, or
        the nodes of a tree with ``parents``), keep the cache and features of the uncached
        tokens and the accepted path (laid out by ``taps``), commit."""
        assert self.cache is not None
        gamma = len(drafts)
        p_logits = out.logits[-(gamma + 1) :]
        chain = parents is None or tree.is_chain(parents)
        if chain:
            accepted, token = self._judge(list(drafts), q_probs, p_logits)
            path = list(range(accepted))
        else:
            path, token = self._judge_tree(list(drafts), list(parents or ()), q_probs, p_logits)
            accepted = len(path)
        kept = tree.kept_columns(fed_before, path)
        if chain:  # the kept columns are a prefix: a view, no copy
            out.cache.crop(self.cache.length + len(kept))
        else:
            out.cache.keep(self.cache.length, kept)
        self.cache = out.cache
        features = None if out.features is None else out.features[kept]
        self._keep_features(features, len(kept), taps)
        self.stats.target_forwards += 1
        if is_round:
            self.stats.rounds += 1
            self.stats.proposed += gamma
            self.stats.accepted += accepted
        self._commit([*(drafts[n] for n in path), token])
        return accepted, [token]

    def _judge(
        self, draft_tokens: list[int], q_probs: torch.Tensor | None, p_logits: torch.Tensor
    ) -> tuple[int, int]:
        """(accepted, next token) from p's logits [gamma + 1, V] at the verified positions."""
        drafts = torch.tensor(draft_tokens, dtype=torch.long)  # [gamma]
        if not draft_tokens:  # nothing to verify: the target's own next token
            return 0, sampling.next_token(p_logits[0], self.params, self.generator)
        if self.params.greedy:
            return sampling.greedy_verify(drafts, p_logits)
        if q_probs is None:
            raise ValueError("a sampled sequence needs the draft probabilities")
        p = sampling.probs_from_logits(p_logits, self.params)  # [gamma + 1, V]
        accepted, token = sampling.rejection_sample(
            drafts[None], q_probs[None], p[None], self.generator
        )
        return int(accepted[0]), int(token[0])

    def _judge_tree(
        self,
        tokens: list[int],
        parents: list[int],
        q_probs: torch.Tensor | None,
        p_logits: torch.Tensor,
    ) -> tuple[list[int], int]:
        """(accepted path, next token) of a token tree from p's logits [N + 1, V] (row 0 the
        root's, row i + 1 node i's); sampled: recursive rejection sampling (starsd.sampling)."""
        if self.params.greedy:
            return sampling.greedy_tree_verify(tokens, parents, p_logits)
        if q_probs is None:
            raise ValueError("a sampled sequence needs the draft probabilities")
        p = sampling.probs_from_logits(p_logits, self.params)  # [N + 1, V]
        q_rows = torch.zeros_like(p)
        for node, parent in enumerate(parents):  # each node's row is its parent's q
            q_rows[parent + 1] = q_probs[node]
        return sampling.tree_rejection_sample(tokens, parents, q_rows, p, self.generator)

    def _keep_features(
        self, features: torch.Tensor | None, n: int, taps: tuple[int, ...] = ()
    ) -> None:
        """Keep the first ``n`` rows (the positions that stay committed) of the own taps out of
        ``features``, laid out by ``taps`` (the forward's)."""
        if features is not None and self.taps:
            own = tap_columns(features[:n], taps, self.taps, self.info.hidden_size)
            self.feature_rows.extend(own.to(torch.float16).unbind(0))

    def _commit(self, tokens: list[int]) -> None:
        # Stop exactly where the target alone would: at the first EOS (kept) or the length limit.
        self.stats.record_commit(len(tokens))
        start = len(self.generated)
        for token in tokens:
            self.generated.append(token)
            if token in self.info.eos_token_ids or len(self.generated) >= self.max_new_tokens:
                self._finish()
                break
        if self.on_commit is not None:
            self.on_commit(self.generated[start:])

    def _finish(self) -> None:
        self.done = True
        self.stats.finished = time.perf_counter()
        self.cache = None  # free the KV cache as soon as the sequence ends


# ---------------------------------------------------------------------- batch operations


def prefill_batch(backend: VerifierBackend, seqs: Sequence[TargetSequence]) -> int:
    """Feed every sequence's uncached prompt tokens but the last, in one forward (rows with
    nothing to feed, such as one-token prompts, are skipped); returns the rows fed."""
    _distinct(seqs)
    rows = [s for s in seqs if not s.done and len(s.uncached()) > 1]
    if rows:
        taps = union_taps(rows)
        outs = backend.forward([_cache(s) for s in rows], [s.uncached()[:-1] for s in rows], taps)
        for seq, out in zip(rows, outs, strict=True):
            seq._keep_features(out.features, len(out.logits), taps)
            seq.cache = out.cache
    for seq in seqs:
        seq.stats.last_commit = time.perf_counter()  # latency counts decoding, not the prefill
    return len(rows)


def union_taps(seqs: Sequence[TargetSequence]) -> tuple[int, ...]:
    """Every tap some of ``seqs`` keep, in first-seen order: what one forward of them taps."""
    return tuple(dict.fromkeys(t for s in seqs for t in s.taps))


def tap_columns(
    features: torch.Tensor, laid_out: tuple[int, ...], wanted: tuple[int, ...], width: int
) -> torch.Tensor:
    """The columns of taps ``wanted`` out of features [n, len(laid_out) width] (each tap's
    hidden state ``width`` wide, side by side in ``laid_out`` order)."""
    if wanted == laid_out:
        return features
    if not set(wanted) <= set(laid_out):
        raise ValueError(f"taps {list(wanted)} are not among those kept, {list(laid_out)}")
    parts = [laid_out.index(t) for t in wanted]
    return torch.cat([features[:, i * width : (i + 1) * width] for i in parts], dim=-1)


def step_batch(backend: VerifierBackend, seqs: Sequence[TargetSequence]) -> list[int]:
    """One token for each sequence from the target alone, all in one forward."""
    results = decode_batch(backend, [(s, (), None) for s in seqs], [False] * len(seqs))
    return [appended[0] for _, appended in results]


def verify_batch(
    backend: VerifierBackend,
    proposals: Sequence[VerifyRow],
    parents: Sequence[Parents] | None = None,
) -> list[tuple[int, list[int]]]:
    """Verify each ``(seq, draft_tokens, q_probs)`` (q [gamma, V], None when greedy) and commit.

    All rows go through ONE backend forward. Returns per row (accepted, appended): how many draft
    tokens were kept and the target's own token after them. Raises ValueError (before any
    forward) for a proposal that :func:`check_proposal` refuses.
    """
    return decode_batch(backend, proposals, [True] * len(proposals), parents)


def check_proposal(
    seq: TargetSequence,
    drafts: Sequence[int],
    q_probs: torch.Tensor | None,
    parents: Parents = None,
) -> None:
    """ValueError naming what is wrong with verifying ``drafts`` (a chain, or a token tree with
    ``parents``) on ``seq`` (nothing if fine)."""
    if seq.done or seq.cache is None:
        raise ValueError("the sequence is finished")
    if parents is not None:
        check_tree(drafts, q_probs, parents)
    # a tree's nodes sit at their depths' positions: its deepest node is its last position
    extent = len(drafts) if parents is None else max(tree.depths(parents), default=0)
    if drafts and not fits_context(seq, extent):  # a step may run on (RoPE models do)
        raise ValueError(
            f"{seq.committed} + {extent} positions exceed the target's {seq.info.max_positions}"
        )
    if any(not 0 <= t < seq.info.vocab_size for t in drafts):
        raise ValueError(f"a draft token is outside the vocabulary of {seq.info.vocab_size}")
    if drafts and not seq.params.greedy:
        shape = (len(drafts), seq.info.vocab_size)
        if q_probs is None or tuple(q_probs.shape) != shape:
            got = None if q_probs is None else tuple(q_probs.shape)
            raise ValueError(f"a sampled proposal needs q probabilities {shape}, got {got}")
        problem = sampling.q_problem(torch.tensor(list(drafts)), q_probs)
        if problem is not None:
            raise ValueError(problem)


def check_tree(drafts: Sequence[int], q_probs: torch.Tensor | None, parents: Sequence[int]) -> None:
    """ValueError for a tree whose parents do not form one, that does not match its tokens,
    whose siblings repeat a token (:func:`starsd.tree.sibling_problem`) or carry different q
    rows (they were drawn from one law; q None: the rows are not checked)."""
    if len(parents) != len(drafts):
        raise ValueError(f"{len(parents)} parents for {len(drafts)} tree nodes")
    problem = tree.tree_problem(list(parents), MAX_TREE_NODES) or tree.sibling_problem(
        list(drafts), list(parents)
    )
    if problem is not None:
        raise ValueError(problem)
    if q_probs is None or len(q_probs) != len(drafts):
        return  # (greedy; a sampled proposal's q shape is checked with the chain's rules)
    first: dict[int, int] = {}
    for node, parent in enumerate(parents):
        sibling = first.setdefault(parent, node)
        if sibling != node and not torch.equal(q_probs[node], q_probs[sibling]):
            raise ValueError(f"tree node {node}'s q differs from its sibling {sibling}'s")


def fits_context(seq: TargetSequence, gamma: int) -> bool:
    """Whether verifying ``gamma`` more tokens stays inside the target's position limit."""
    limit = seq.info.max_positions
    return limit is None or seq.committed + gamma <= limit


def decode_batch(
    backend: VerifierBackend,
    proposals: Sequence[VerifyRow],
    rounds: Sequence[bool],
    parents: Sequence[Parents] | None = None,
) -> list[tuple[int, list[int]]]:
    """Verifications and steps mixed: ONE forward of every row (its uncached tokens, then its
    drafts: a chain, or a token tree where ``parents[i]`` is given), then each row judged alone
    with its own generator. ``rounds[i]`` says whether row i counts as a verification round
    (False: a standalone step) in the sequence's stats."""
    _distinct([seq for seq, _, _ in proposals])
    shapes = list(parents) if parents is not None else [None] * len(proposals)
    for (seq, drafts, q_probs), shape in zip(proposals, shapes, strict=True):
        check_proposal(seq, drafts, q_probs, shape)
    uncached = [seq.uncached() for seq, _, _ in proposals]
    feeds = [[*u, *drafts] for u, (_, drafts, _) in zip(uncached, proposals, strict=True)]
    taps = union_taps([seq for seq, _, _ in proposals])
    trees = [
        None if shape is None or tree.is_chain(shape) else tree.TreeFeed(len(u), shape)
        for u, shape in zip(uncached, shapes, strict=True)
    ]
    caches = [_cache(seq) for seq, _, _ in proposals]
    outs = backend.forward(caches, feeds, taps, trees if any(trees) else None)
    return [
        seq._apply(drafts, q, out, len(u), is_round, taps, shape)
        for (seq, drafts, q), u, out, is_round, shape in zip(
            proposals, uncached, outs, rounds, shapes, strict=True
        )
    ]


def _cache(seq: TargetSequence) -> SequenceCache:
    if seq.cache is None:
        raise ValueError("the sequence is finished")
    return seq.cache


def _distinct(seqs: Sequence[TargetSequence]) -> None:
    """A sequence twice in one batch would have both rows commit on one cache."""
    if len({id(s) for s in seqs}) != len(seqs):
        raise ValueError("a sequence appears twice in one batch")
