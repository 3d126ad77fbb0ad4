"""Pre-drafting: while no real job waits, draft ahead for the verdicts most likely to come back.

Drafting thread only: the engine creates, calls and owns the :class:`Predrafter`; nothing here is
shared with the event loop. Draft LLM only: an EAGLE draft needs the target's features of the
tokens a verdict commits, which exist only once the verdict arrives.

After a proposal d_1..d_gamma goes out, its verdict commits d_1..d_k and one token c of the
target's: for k < gamma a correction (c != d_{k+1}), for k = gamma the bonus. A *branch* (k, c) is
the proposal drafting would make after that verdict, drafted now. Branches are ranked by the
draft's own estimate of how likely that verdict is::

    P(k, c) ~ q_1(d_1) * ... * q_k(d_k) * q_{k+1}(c)

(its confidence in the tokens accepted, then in c among the alternatives at k + 1; the rejection
factor 1 - q(d_{k+1}) cancels against renormalising q without d_{k+1}). q_{gamma+1} needs one more
forward, the *probe*, feeding d_gamma. A verdict that matches a branch (same k, the one appended
token c) in a round whose gamma is at most the branch's is answered from it with no model work:
the session takes the branch's first gamma tokens, q rows, KV positions and generator state,
which are exactly what drafting after that verdict would have produced, because the branch drew
with a copy of the session's generator as it stood and fed the same committed prefix (a branch
still being drafted is finished first). Under ``--gamma auto`` a branch drafts ``reach`` = 1
token more than its session's gamma, for a round whose gamma grows. Any other verdict drops the
session's branches and is drafted as usual, from session state that pre-drafting never touched.

Pushed branches: a session opened with ``push`` (Open.push) has up to that many of its branches
sent to its target as soon as they are drafted (:meth:`Predrafter._push`, through the engine's
send), as PROPOSALs naming their verdict. A target whose verdict matches one verifies it without
waiting for the hub and says so in its DRAFT (``taken``); the hub then commits exactly that
branch (the same ``_take``), sends nothing, and pre-drafts the next round at once, while the
target verifies. Only a branch pushed at that length can answer a taken verdict.

Real jobs come first: the engine calls :meth:`Predrafter.step` only while Q_in is empty, and a
step is one forward of at most ``rows`` rows, so a job that arrives waits for one small step.
Under load not even that: with more than ``max_in_flight`` proposals out (``--predraft-max-in-
flight``, 2) there is no step at all, because the hub's idle gaps are then short, few branches
hit (measured here at N = 4: 2-16 % of verdicts) and every step delays the jobs that arrive
during it; one target at --concurrency 8 ran 6-8 % slower with pre-drafting than without, while
at --concurrency 1 pre-drafting made it 12-16 % faster (alternated runs, default pair).
Memory is bounded: at most ``branches`` branches per session (gamma positions of KV each, stored
apart from the session's cache) and at most ``max_sessions`` sessions waiting for verdicts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from starsd.hub.drafters.base import DraftJob, commit_verdict, make_proposal
from starsd.hub.drafters.llm import LlmProposer, LlmRow, LlmState
from starsd.protocol import Proposal

log = logging.getLogger("starsd.hub")


@dataclass(eq=False)  # (identity: a batch groups its rows by session)
class Waiting:
    """A session whose proposal is out: its finished branches, keyed by (k, c)."""

    tag: bytes
    state: LlmState
    seq: int = 0  # the seq of the proposal its branches are (the verdict's DRAFT seq)
    push: int = 0  # branches its target takes pushed (Open.push; 0: none)
    branches: dict[tuple[int, int], LlmRow] = field(default_factory=dict)
    pushed: dict[tuple[int, int], int] = field(default_factory=dict)  # (k, c) -> tokens sent


@dataclass
class PredraftStats:
    """Drafting-thread counters (read by the engine, which copies them under the hub lock)."""

    hits: int = 0  # verdicts answered from a branch
    answered: int = 0  # verdicts of sessions that had been offered for pre-drafting
    branches: int = 0  # branches drafted
    late_hits: int = 0  # hits whose branch was still being drafted (finished on the spot)
    taken: int = 0  # verdicts whose target had already taken a pushed branch
    busy_s: float = 0.0  # time spent pre-drafting (off the critical path by construction)


class Predrafter:
    """Branches for the sessions whose verdicts are out, drafted one forward at a time."""

    def __init__(
        self,
        proposer: LlmProposer,
        branches: int = 4,
        rows: int = 32,
        max_sessions: int = 256,
        reach: int = 0,
        max_in_flight: int | None = None,
    ) -> None:
        proposer.record_alternatives = True  # the top-k per position that branches come from
        self.proposer = proposer
        self.branches = branches
        # tokens a branch drafts beyond the session's gamma: under --gamma auto the next
        # round's gamma may grow by one, and a hit at any gamma up to the branch's own is exact
        self.reach = reach
        self.rows = rows
        self.max_sessions = max_sessions
        # no pre-draft step while more proposals than this are out (None: always)
        self.max_in_flight = max_in_flight
        self.waiting: OrderedDict[bytes, Waiting] = OrderedDict()  # oldest first
        self.to_probe: list[Waiting] = []
        self.to_draft: list[tuple[Waiting, LlmRow]] = []
        self.running: tuple[Iterator[None], list[tuple[Waiting, LlmRow]]] | None = None
        self.stats = PredraftStats()
        # sends a session's pushed branches (tag, proposals) and returns how many went out;
        # set by the engine (it owns the sockets and the lock); None: nothing is pushed
        self.send_branches: Callable[[bytes, list[Proposal]], int] | None = None

    # ------------------------------------------------------------------ the engine's calls

    def offer(self, tag: bytes, state: LlmState, seq: int = 0, push: int = 0) -> None:
        """Session ``tag`` just got a proposal: pre-draft its likely verdicts when idle, which
        will come in DRAFT ``seq``; push up to ``push`` of the branches to its target."""
        if not state.proposed or len(state.alternatives) != len(state.proposed):
            return
        self.waiting.pop(tag, None)
        while len(self.waiting) >= self.max_sessions:
            self.waiting.popitem(last=False)
        waiting = Waiting(tag, state, seq, push)
        self.waiting[tag] = waiting
        self.to_probe.append(waiting)

    def connect_push(self, send: Callable[[bytes, list[Proposal]], int]) -> None:
        """Push branches to the targets that take them through ``send`` (the engine's)."""
        self.send_branches = send

    def has_work(self) -> bool:
        """Whether a pre-draft step would do anything, and is worth doing at this load."""
        if self.over_limit():
            return False
        return bool(self.running or self.to_probe or self.to_draft)

    def over_limit(self) -> bool:
        """Whether more proposals are out than pre-drafting pays for (see the module doc)."""
        return self.max_in_flight is not None and len(self.waiting) > self.max_in_flight

    def prune(self, is_open: Callable[[bytes], bool]) -> None:
        """Forget the sessions closed since their proposal went out (their verdicts never
        come): else they would count as proposals out for ever."""
        for tag in [tag for tag in self.waiting if not is_open(tag)]:
            del self.waiting[tag]

    def drop_all(self) -> None:
        """Drop every branch and the running batch (after a failed round: their drafting
        state may be half-advanced)."""
        self.waiting.clear()
        self.to_probe.clear()
        self.to_draft.clear()
        self.running = None

    def forget(self, tag: bytes) -> None:
        """Drop the session's branches: its verdict came in a round no branch can answer (a span
        alone, or the probe after one, whose verdict is not the one they were drafted for)."""
        self.waiting.pop(tag, None)

    def answer(self, job: DraftJob) -> Proposal | None:
        """The proposal for ``job`` from a matching branch, or None (draft it as usual)."""
        waiting = self.waiting.pop(job.tag, None)
        if waiting is None or waiting.state is not job.state:
            return None
        self.stats.answered += 1
        if job.taken:  # the target holds the pushed branch already: only that one will do
            branch, gamma = self._pushed(waiting, job), job.taken
        else:
            branch = self._match(waiting, job) or self._finish_for(waiting, job)
            gamma = self._gamma(waiting.state, len(waiting.state.tokens) + job.accepted + 1)
        if branch is None:
            return None
        self.stats.hits += 1
        self.stats.taken += bool(job.taken)
        return self._take(job, branch, gamma)

    def step(self) -> None:
        """One forward of pre-draft work: advance a branch batch, probe, or start a batch."""
        started = time.perf_counter()
        try:
            if self.running is None and not self._start():
                return
            self._advance()
        except Exception:  # pre-drafting is an optimisation: drop the work, keep drafting
            log.exception("pre-drafting failed; dropping %d branches", len(self._running_items()))
            self.running = None
        finally:
            self.stats.busy_s += time.perf_counter() - started

    # ------------------------------------------------------------------ branches

    def _start(self) -> bool:
        """Probe waiting sessions, else start drafting queued branches; False if no work."""
        if self.to_probe:
            self._probe()
            return False  # the probe was this step's forward
        items = [(w, row) for w, row in self.to_draft[: self.rows] if self._alive(w)]
        del self.to_draft[: self.rows]
        if not items:
            return False
        self.running = (self.proposer.draft_steps([row for _, row in items]), items)
        return True

    def _advance(self) -> None:
        assert self.running is not None
        steps, items = self.running
        if next(steps, StopIteration) is StopIteration:
            self._keep(items)
        else:  # branches with this round's gamma drawn go out now (the rest reach one further)
            for waiting, rows in _by_session(items).items():
                if self._alive(waiting):
                    self._push(waiting, rows)

    def _finish_for(self, waiting: Waiting, job: DraftJob) -> LlmRow | None:
        """A verdict whose branch is being drafted: finish that batch now and answer from it.

        Its remaining steps cost no more than drafting the verdict from scratch (the probe and
        the feed are done, and a step of a few rows costs about one of a single row), and the
        branch is exactly what that drafting would produce.
        """
        key = (job.accepted, job.appended[0]) if len(job.appended) == 1 else None
        if key is None or not self._finish_running(waiting, key):
            return None
        self.stats.late_hits += 1
        return self._match(waiting, job)

    def _finish_running(self, waiting: Waiting, key: tuple[int, int]) -> bool:
        """If the running batch drafts ``waiting``'s branch ``key`` (its verdict is in, so the
        session is no longer waiting), finish the batch now and keep that session's branches."""
        items = self._running_items()
        if not any(w is waiting and _key(row) == key for w, row in items):
            return False
        for _ in self.running[0] if self.running else ():
            pass
        self._keep(items)
        waiting.branches.update((_key(row), row) for w, row in items if w is waiting)
        return True

    def _keep(self, items: list[tuple[Waiting, LlmRow]]) -> None:
        """The running batch is done: keep each live session's branches."""
        self.running = None
        for waiting, rows in _by_session(items).items():
            if self._alive(waiting):
                for row in rows:
                    waiting.branches[_key(row)] = row
                    self.stats.branches += 1
                self._push(waiting, rows)

    def _push(self, waiting: Waiting, rows: list[LlmRow]) -> None:
        """Send the session's branches among ``rows`` (most likely first) that have this
        round's gamma drawn and are not out yet to its target, as many as it takes: a verdict
        that matches one is then verified without waiting for the hub."""
        if self.send_branches is None or len(waiting.pushed) >= waiting.push:
            return
        state, proposals = waiting.state, []
        for row in rows:
            gamma = min(row.gamma, self._gamma(state, len(state.tokens) + row.job.accepted + 1))
            if _key(row) not in waiting.pushed and 1 <= gamma <= len(row.tokens):
                proposals.append(_branch_proposal(row, gamma, state))
        proposals = proposals[: waiting.push - len(waiting.pushed)]
        for proposal in proposals[: self.send_branches(waiting.tag, proposals)]:
            assert proposal.branch is not None
            waiting.pushed[proposal.branch] = len(proposal.tokens)

    def _pushed(self, waiting: Waiting, job: DraftJob) -> LlmRow | None:
        """The branch a DRAFT with ``taken`` says its target took: pushed with that length
        (finished first if it is still being drafted: it was pushed once its gamma was drawn)."""
        key = (job.accepted, job.appended[0])
        if waiting.pushed.get(key) != job.taken:
            return None
        if key not in waiting.branches:
            self._finish_running(waiting, key)
        return waiting.branches.get(key)

    def _probe(self) -> None:
        """The draft's alternatives for the bonus token, then every session's best branches."""
        batch = [w for w in self.to_probe[: self.rows] if self._alive(w)]
        del self.to_probe[: self.rows]
        if not batch:
            return
        logits = self.proposer.next_logits(
            [w.state.cache for w in batch], [w.state.proposed[-1] for w in batch]
        )  # [B, V]
        top = torch.softmax(logits.float(), dim=-1).topk(self.branches, dim=-1)
        for i, waiting in enumerate(batch):
            bonus = (top.indices[i].tolist(), top.values[i].tolist())
            self.to_draft.extend((waiting, row) for row in self._rows(waiting, bonus))

    def _rows(self, waiting: Waiting, bonus: tuple[list[int], list[float]]) -> list[LlmRow]:
        """Rows for the session's most likely verdicts (k, c), most likely first."""
        state = waiting.state
        ranked = sorted(
            _verdicts(state.proposed, [*state.alternatives, bonus], state.acceptance), reverse=True
        )
        rows = []
        for _, k, token in ranked[: self.branches]:
            row = self._row(waiting, k, token)
            if row is not None:
                rows.append(row)
        return rows

    def _row(self, waiting: Waiting, k: int, token: int) -> LlmRow | None:
        state = waiting.state
        committed = [*state.tokens, *state.proposed[:k], token]
        gamma = self._gamma(state, len(committed), self.reach)
        if gamma < 1:
            return None
        prefix = min(state.cache.length, len(state.tokens) + k)  # as apply_verdict would crop
        generator = torch.Generator().set_state(state.generator.get_state())
        job = DraftJob(waiting.tag, waiting.seq, state, k, (token,))
        return LlmRow(
            job,
            gamma,
            feed=committed[prefix:],
            source=state.cache.prefix(prefix),
            whole=False,
            generator=generator,
            alternatives=[],
            vocab=self.proposer.vocab,
        )

    def _match(self, waiting: Waiting, job: DraftJob) -> LlmRow | None:
        if len(job.appended) != 1:
            return None
        row = waiting.branches.get((job.accepted, job.appended[0]))
        committed = len(waiting.state.tokens) + job.accepted + 1
        if row is None or not 1 <= self._gamma(waiting.state, committed) <= row.gamma:
            return None
        return row

    def _take(self, job: DraftJob, row: LlmRow, gamma: int) -> Proposal:
        """Commit the verdict and the branch's first ``gamma`` (<= row.gamma) tokens into the
        session: what drafting would have done.

        A round at a shorter gamma than the branch's takes its first ``gamma`` tokens: the
        same tokens, q rows, KV positions and generator state as drafting them would give.
        """
        state: LlmState = job.state
        prefix = min(state.cache.length, len(state.tokens) + job.accepted)
        commit_verdict(state, job.accepted, job.appended)
        assert row.cache is not None
        drafted = row.cache.prefix(len(row.feed) + gamma - 1)  # the feed, then gamma - 1 steps
        state.cache = state.cache.prefix(prefix).extended(drafted)
        rng = row.rng_states[gamma - 1] if row.rng_states else row.rng.get_state()
        state.generator.set_state(rng)
        state.alternatives = (row.alternatives or [])[:gamma]
        state.proposed = row.tokens[:gamma]
        return make_proposal(
            job, state.proposed, row.q_rows[:gamma], state.params, self.proposer.vocab
        )

    def _gamma(self, state: LlmState, committed: int, reach: int = 0) -> int:
        limit = self.proposer.max_positions
        gamma = state.gamma + reach
        return gamma if limit is None else min(gamma, limit - committed)

    def _alive(self, waiting: Waiting) -> bool:
        return self.waiting.get(waiting.tag) is waiting

    def _running_items(self) -> list[tuple[Waiting, LlmRow]]:
        return self.running[1] if self.running else []


def _by_session(items: list[tuple[Waiting, LlmRow]]) -> dict[Waiting, list[LlmRow]]:
    """A batch's rows per session, in batch order (most likely first)."""
    out: dict[Waiting, list[LlmRow]] = {}
    for waiting, row in items:
        out.setdefault(waiting, []).append(row)
    return out


def _branch_proposal(row: LlmRow, gamma: int, state: LlmState) -> Proposal:
    """Branch ``row``'s first ``gamma`` tokens as a pushed PROPOSAL, with the verdict it holds
    for (the same tokens and q rows that answering that verdict from it sends)."""
    k, token = _key(row)
    proposal = make_proposal(
        row.job, row.tokens[:gamma], row.q_rows[:gamma], state.params, row.vocab
    )
    return dataclasses.replace(proposal, if_accepted=k, if_appended=token)


def _key(row: LlmRow) -> tuple[int, int]:
    """The verdict (k, c) a branch row drafts after."""
    return row.job.accepted, row.job.appended[0]


def _verdicts(
    proposed: list[int], alternatives: list[tuple[list[int], list[float]]], alpha: float
) -> list[tuple[float, int, int]]:
    """(estimated probability, k, c) of every verdict the alternatives allow.

    The session's acceptance rate ``alpha`` says how far the target goes (the draft's own
    probabilities are too flat for that: a trained draft's top token is accepted far more often
    than its probability says); q says which token it then emits, renormalised without the
    rejected draft token for a correction.
    """
    out: list[tuple[float, int, int]] = []
    reach = 1.0  # estimated probability that d_1..d_k are all accepted
    for k, (ids, probs) in enumerate(alternatives):
        if k == len(proposed):  # all accepted: the bonus token
            out.extend((reach * p, k, c) for c, p in zip(ids, probs, strict=True))
            break
        drafted = proposed[k]
        q_drafted = dict(zip(ids, probs, strict=True)).get(drafted, 0.0)
        rejected = reach * (1 - alpha) / max(1e-6, 1 - q_drafted)
        out.extend((rejected * p, k, c) for c, p in zip(ids, probs, strict=True) if c != drafted)
        reach *= alpha
    return out
