"""What every proposer shares: the ``Proposer`` protocol, a draft job, chain state and its helpers.

A proposer turns draft jobs into proposals on the hub's drafting thread, and only there. Each
kind (``llm``, ``eagle``, ``null``) lives in its own module with its own state type; the state of
a session is created by ``new_state`` on the event loop (no model work) and from then on touched
only by the drafting thread.

Terms (as in the target's rejection sampler): after a proposal of gamma draft tokens the target
sends a verdict, ``accepted`` (how many draft tokens it kept) and ``appended`` (the tokens it
committed after them: the recovered or bonus token, plus any it decoded alone meanwhile).
:func:`commit_verdict` is the one place that applies a verdict to the committed tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from starsd import sampling, tree
from starsd.hub.drafters.tree_draft import GrownTree
from starsd.hub.drafters.vocab import DraftVocab
from starsd.hub.policy import SessionPacing
from starsd.protocol import Error, ErrorCode, Proposal, SamplingParams
from starsd.tree_shapes import TreeShape

log = logging.getLogger("starsd.hub.drafters")


@dataclass
class ChainState:
    """Draft-side state every chain proposer keeps for one session."""

    tokens: list[int]  # committed by the target: prompt + generated
    params: SamplingParams
    gamma: int
    generator: torch.Generator  # the session's own draws, whoever else is drafted
    proposed: list[int] = field(default_factory=list)  # the last proposal's draft tokens
    # the last proposal's tree (parents per token, starsd.tree), None: a chain
    proposed_parents: list[int] | None = None
    # this round's shape, set by the pacer (drafting thread): a token tree, or None: a chain
    tree: TreeShape | None = None
    drafted: int = 0  # draft tokens proposed so far (verdicts received)
    kept: int = 0  # of which the target accepted
    # --gamma auto's estimates for this session (starsd.hub.policy.SessionPacing), made by the
    # drafting engine's pacer on the session's first job
    pacing: SessionPacing | None = None

    @property
    def acceptance(self) -> float:
        """The session's acceptance rate so far, with a flat prior (0.5 before any verdict)."""
        return (self.kept + 1) / (self.drafted + 2)


S = TypeVar("S", bound=ChainState)
T = TypeVar("T")


@dataclass(frozen=True)
class DraftJob(Generic[S]):
    """A request for proposal ``seq`` after applying the verdict (accepted, appended)."""

    tag: bytes
    seq: int
    state: S
    accepted: int
    appended: tuple[int, ...]
    enqueued_at: float = field(default_factory=time.perf_counter)
    features: np.ndarray | None = None  # EAGLE: [n, H] target features that came with it
    # > 0: the target took the pushed branch for this verdict (its length): commit it, send
    # nothing; only a pre-drafter answers such a job (Draft.taken)
    taken: int = 0
    push: int = 0  # pushed branches per round the session's target takes (Open.push)
    proposed: int = 0  # tokens of the proposal this verdict answers (0: a span alone, or none)
    owner: bytes = b""  # the session's target (its key): its auto sessions share their figures
    auto: bool = False  # the hub chooses this session's gamma every round (--gamma auto)
    # the verdict on a token tree: the accepted path's nodes (Draft.path); None after a chain
    path: tuple[int, ...] | None = None
    tree_nodes: int = 0  # > 0: the session's target verifies token trees of this many nodes
    # seconds its target spent on forwards that did not carry the session while this verdict
    # was due (Draft.others_us): its gamma does not change them, so the round trip is priced
    # without them
    others_s: float = 0.0
    # the mean seconds of the target's forwards that carried the session meanwhile, its
    # verification or its steps alone (Draft.forward_us; 0: not measured)
    forward_s: float = 0.0


class Proposer(Protocol[S]):
    """One drafting kind: makes per-session state and drafts proposals for jobs."""

    kind: str  # the --draft-kind name, announced in WELCOME
    feature_width: int  # > 0: drafts from target features, which OPEN and DRAFT must carry
    # the target hidden states a feature row holds (starsd.llama.tapped): () its last one
    feature_layers: tuple[int, ...]
    max_positions: int | None  # the draft's context limit, None when unbounded
    trees: bool  # whether it drafts token trees (ChainState.tree); chains only when False

    def new_state(self, prompt: list[int], params: SamplingParams, gamma: int) -> S:
        """State for a new session; nothing is computed until its first job."""
        ...

    def propose(self, jobs: list[DraftJob[S]]) -> list[Proposal | Error]:
        """Apply each job's verdict and draft its next proposal: one result per job, in order."""
        ...


def new_chain_state(prompt: list[int], params: SamplingParams, gamma: int) -> ChainState:
    """The shared part of a session's state: committed tokens and its own generator."""
    generator = sampling.make_generator(params.seed)
    return ChainState(tokens=list(prompt), params=params, gamma=gamma, generator=generator)


def commit_verdict(
    state: ChainState,
    accepted: int,
    appended: tuple[int, ...],
    path: tuple[int, ...] | None = None,
) -> None:
    """Commit the first ``accepted`` proposed tokens (after a tree: the nodes on ``path``, which
    the session table checked against the tree), then ``appended``; forget the proposal."""
    if path is None:
        state.tokens.extend(state.proposed[:accepted])
    else:
        state.tokens.extend(state.proposed[node] for node in path)
    state.tokens.extend(appended)
    state.drafted += len(state.proposed) if path is None else _depth(state.proposed_parents)
    state.kept += accepted
    state.proposed, state.proposed_parents = [], None


def _depth(parents: list[int] | None) -> int:
    """A tree's depth: the draft positions it proposed for the acceptance rate."""
    return max(tree.depths(parents), default=0) if parents else 0


def fitting_gamma(state: ChainState, max_positions: int | None) -> int:
    """The session's gamma, shortened so the draft never runs past its context limit."""
    if max_positions is None:
        return state.gamma
    return min(state.gamma, max_positions - len(state.tokens))


def fitting_tree(state: ChainState, max_positions: int | None) -> TreeShape | None:
    """The round's tree shape, its depth shortened to the draft's context (None: a chain)."""
    shape = state.tree
    if shape is None or max_positions is None:
        return shape
    depth = min(shape.depth, max_positions - len(state.tokens))
    return dataclasses.replace(shape, depth=depth) if depth >= 1 else None


def by_shape(rows: Sequence[R]) -> list[tuple[TreeShape | None, list[R]]]:
    """Rows grouped by their round's shape (None: chains), each group drafted in its own
    forwards: a tree's columns and a chain's steps do not share a feed."""
    groups: dict[TreeShape | None, list[R]] = {}
    for row in rows:
        groups.setdefault(row.shape, []).append(row)
    return list(groups.items())


def propose_each(
    jobs: list[DraftJob[S]], draft_one: Callable[[DraftJob[S]], Proposal | Error]
) -> list[Proposal | Error]:
    """Draft jobs one after another; a failing session costs its own job an INTERNAL error."""
    results: list[Proposal | Error] = []
    for job in jobs:
        try:
            results.append(draft_one(job))
        except Exception as exc:  # one bad session must not take the drafting thread down
            log.exception("drafting failed for session %s", job.tag.hex()[:8])
            results.append(_job_error(job, ErrorCode.INTERNAL, f"drafting failed: {exc}"))
    return results


@dataclass
class ChainRow(Generic[S]):
    """One job's row in a drafted batch: what it drafts, and what it has drawn so far."""

    job: DraftJob[S]
    gamma: int  # draft tokens this row proposes (its session's, fitted to the context)
    tokens: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)  # [V] each, sampled sessions only
    generator: torch.Generator | None = None  # a pre-draft branch's copy; None: the session's
    # the draft's top tokens and probabilities at each drawn position, when pre-drafting wants
    # them (None: not recorded)
    alternatives: list[tuple[list[int], list[float]]] | None = None
    # a sampled branch's generator state after each draw (a shorter hit resumes from one)
    rng_states: list[torch.Tensor] = field(default_factory=list)
    vocab: DraftVocab | None = None  # the draft's reduced vocabulary, if any (its proposer's)
    shape: TreeShape | None = None  # this round's tree shape (None: a chain of ``gamma``)
    grown: GrownTree | None = None  # a tree round's tree, once drafted (None: a chain)

    @property
    def state(self) -> S:
        """The session's draft state (owned by the drafting thread)."""
        return self.job.state

    @property
    def rng(self) -> torch.Generator:
        """The generator this row draws with."""
        return self.generator if self.generator is not None else self.state.generator

    def restart(self) -> None:
        """Forget what a failed batch drew, before the row is drafted again alone."""
        self.tokens, self.q_rows, self.rng_states, self.grown = [], [], [], None

    def new_tree(self) -> GrownTree:
        """An empty tree for this row's round, drawn with the row's generator."""
        return GrownTree(self.state.params, self.rng)

    def proposal(self) -> Proposal:
        """The wire proposal of what the row drew; the session remembers it for the verdict."""
        if self.grown is not None:
            return self._tree_proposal(self.grown)
        self.state.proposed = self.tokens
        return make_proposal(self.job, self.tokens, self.q_rows, self.state.params, self.vocab)

    def _tree_proposal(self, grown: GrownTree) -> Proposal:
        self.state.proposed, self.state.proposed_parents = grown.tokens, grown.parents
        made = make_proposal(self.job, grown.tokens, grown.q_rows, self.state.params, self.vocab)
        parents = np.asarray(grown.parents, dtype=np.int32)  # [N]
        return dataclasses.replace(made, parents=parents)


R = TypeVar("R", bound=ChainRow)  # a proposer's own row type


def draw_step(
    logits: torch.Tensor, rows: Sequence[ChainRow[S]], step: int, vocab: DraftVocab | None = None
) -> torch.Tensor:
    """Draft token ``step`` of every row from ``logits`` [B, V] (or [B, K] over a reduced
    ``vocab``); returns the tokens [B] to feed (draft ids). Rows record target ids.

    Greedy rows take one batched argmax; a sampled row draws with its own session generator, so
    its tokens do not depend on which sessions share the batch. A row whose proposal is complete
    feeds its argmax, computed and then discarded.
    """
    fed = torch.argmax(logits, dim=-1)  # [B]
    greedy = (fed if vocab is None else vocab.to_target(fed)).tolist()  # one conversion a batch
    _record_alternatives(logits, rows, step, vocab)
    for i, row in enumerate(rows):
        if step >= row.gamma:
            continue
        if row.state.params.greedy:
            row.tokens.append(greedy[i])
            continue
        token, q = draw(logits[i], row.state.params, row.rng)
        if row.generator is not None:
            row.rng_states.append(row.generator.get_state())
        row.tokens.append(token if vocab is None else int(vocab.d2t[token]))
        row.q_rows.append(q)  # type: ignore[arg-type]  # (a sampled draw returns q)
        fed[i] = token
    return fed


ALTERNATIVES = 4  # top draft tokens recorded per position for pre-drafting's branches


def _record_alternatives(
    logits: torch.Tensor, rows: Sequence[ChainRow[S]], step: int, vocab: DraftVocab | None
) -> None:
    """The draft's top tokens (target ids) at this position, for rows that record them (one
    batched top-k; the plain softmax ranks branches for every session, greedy or not)."""
    wanted = [i for i, row in enumerate(rows) if row.alternatives is not None and step < row.gamma]
    if not wanted:
        return
    top = torch.softmax(logits[wanted].float(), dim=-1).topk(ALTERNATIVES, dim=-1)  # [b, F]
    ids = top.indices if vocab is None else vocab.to_target(top.indices)
    for j, i in enumerate(wanted):
        rows[i].alternatives.append(  # type: ignore[union-attr]
            (ids[j].tolist(), top.values[j].tolist())
        )


def propose_batched(
    jobs: list[DraftJob[S]],
    prepare: Callable[[DraftJob[S]], R | Proposal | Error],
    draft: Callable[[list[R]], None],
) -> list[Proposal | Error]:
    """Prepare each job (its verdict, its own errors), draft the rows as one batch, reply.

    ``prepare`` applies a job's verdict exactly once and returns a row, or a result needing no
    model work. ``draft`` fills the rows' tokens and commits their caches only once the whole
    batch has succeeded; if it raises, each row is drafted again alone, so a session that breaks
    a forward costs its own job an INTERNAL error and never the rest of its batch.
    """
    results: dict[int, Proposal | Error] = {}
    rows: dict[int, R] = {}
    for i, job in enumerate(jobs):
        prepared = _guarded(job, functools.partial(prepare, job), "preparing")
        if isinstance(prepared, ChainRow):
            rows[i] = prepared
        else:
            results[i] = prepared
    if rows:
        _draft_rows(rows, draft, results)
    return [results[i] for i in range(len(jobs))]


def _draft_rows(
    rows: dict[int, R], draft: Callable[[list[R]], None], results: dict[int, Proposal | Error]
) -> None:
    try:
        draft(list(rows.values()))
    except Exception:
        log.exception("a batch of %d failed; drafting its sessions one at a time", len(rows))
        for i, row in rows.items():
            row.restart()
            results[i] = _guarded(row.job, functools.partial(_draft_alone, row, draft), "drafting")
        return
    results.update((i, row.proposal()) for i, row in rows.items())


def _draft_alone(row: R, draft: Callable[[list[R]], None]) -> Proposal:
    draft([row])
    return row.proposal()


def _guarded(job: DraftJob[S], work: Callable[[], T], what: str) -> T | Error:
    try:
        return work()
    except Exception as exc:  # one bad session must not take the drafting thread down
        log.exception("%s failed for session %s", what, job.tag.hex()[:8])
        return _job_error(job, ErrorCode.INTERNAL, f"{what} failed: {exc}")


def context_full(job: DraftJob[S]) -> Error:
    """The reply when the draft has no room left for even one token."""
    return _job_error(job, ErrorCode.CONTEXT_FULL, "draft context is full")


def _job_error(job: DraftJob[S], code: str, message: str) -> Error:
    return Error(code, message, tag=job.tag, seq=job.seq)


def draw(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    """One draft token from ``logits`` [V]; with sampling also q, its distribution [V]."""
    if params.greedy:
        return int(torch.argmax(logits)), None
    q = sampling.probs_from_logits(logits, params)  # [V]
    return int(sampling.sample(q[None], gen)[0]), q


def make_proposal(
    job: DraftJob[S],
    tokens: list[int],
    q_rows: list[torch.Tensor],
    params: SamplingParams,
    vocab: DraftVocab | None = None,
) -> Proposal:
    """The wire proposal in target ids: tokens, and q as none (greedy), sparse (top-k / top-p,
    and a reduced ``vocab``: its own ids are the support) or dense."""
    token_arr = np.asarray(tokens, dtype=np.int32)  # [gamma]
    if params.greedy or not tokens:
        return Proposal(tag=job.tag, seq=job.seq, tokens=token_arr)
    q = torch.stack(q_rows)  # [gamma, V] (or [gamma, K] over a reduced vocabulary)
    if params.truncated:
        support, probs = sampling.sparse_q(q)  # [gamma, k] each
        if vocab is not None:
            support = vocab.to_target(support.long()).to(torch.int32)
        return Proposal(job.tag, job.seq, token_arr, probs.numpy(), support.numpy())
    if vocab is not None:  # q over the draft's K ids, 0 elsewhere: K ids travel, not V probs
        support = vocab.d2t.to(torch.int32).expand(len(tokens), -1)
        return Proposal(job.tag, job.seq, token_arr, q.float().numpy(), support.numpy().copy())
    return Proposal(job.tag, job.seq, token_arr, q.numpy().astype(np.float32))
