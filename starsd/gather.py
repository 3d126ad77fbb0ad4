"""Gathering: let a batch wait a moment for the requests that are about to arrive.

Two users, one problem: the hub's drafting engine waits for the verdicts due back from targets
(``starsd.hub.engine``), and a target's batcher waits for the proposals due back from its hub
(``edge.batcher``); each owns its :class:`Returns` (one thread touches it). With batched
drafting a batch of 32 costs little more than a batch of 1, so a hub that drafts whatever is
waiting the moment it is free splits its targets into groups that alternate: measured at N = 32
on the emulated sweep, batches of 1 (24 ms) and of 31 (56 ms) took turns, every round paid for
both, and the hub was busy all the time while one batch of 32 plus the round trip would have
taken 64 ms. Dynamic batchers (Triton's ``max_queue_delay``) solve this with a fixed delay; here
the hub knows when each verdict is due: it sent the proposal, and it measures each session's
round trip R (from the proposal leaving to the next DRAFT arriving). So before drafting a batch
the engine waits for the sessions whose verdicts are due within ``window`` (at most the time one
more batch would cost, which the wait saves), and not at all for a session already overdue (it
may be decoding alone, or gone). A target does the same before a verification forward:
measured at ``--concurrency 8`` through one hub (default pair, 200 tokens, alternated), rows per
forward went from 3.5 to 6.9 and the forwards halved, for the same or slightly better
throughput.

Cohorts: requests whose answers come back together. A target verifies all of its sequences that
have a proposal in one forward and sends their DRAFTs back to back, so on the hub one target's
sessions are a cohort (``sent(..., cohort=owner)``). When an answer arrives, the other requests
of its cohort that went out no later than it did were verified in the same forward: they are
due now, whatever their round trips predict. Round trips alone missed them: at ``--concurrency
8`` a target's forwards take 100-210 ms as its rows vary, each session's R swung by more than
the hub's window (one batch's service time, ~9 ms), and the hub drafted one forward's 8
verdicts in two batches (1 + 7, 2 + 6, ...) in most rounds: 184 batches for the target's 121
forwards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

_SMOOTHING = 0.3  # weight of the newest round trip in a session's R
_LATE = 0.25  # a verdict this much of R past due is no longer waited for


class Returns:
    """When each session's answer is due: its request's send time plus its round trip R."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self.sent_at: OrderedDict[Hashable, float] = OrderedDict()  # requests out, oldest first
        self.round_trip: dict[Hashable, float] = {}  # R per session (smoothed)
        self.cohort: dict[Hashable, Hashable] = {}  # a request's cohort, while it is out

    def sent(self, tag: Hashable, at: float, cohort: Hashable | None = None) -> None:
        """A proposal for ``tag`` went out at ``at``; ``cohort``: whose answers come with it."""
        self.sent_at.pop(tag, None)
        self.sent_at[tag] = at
        if cohort is None:
            self.cohort.pop(tag, None)  # (a request sent without one has none)
        else:
            self.cohort[tag] = cohort
        while len(self.sent_at) > self.max_sessions:
            old, _ = self.sent_at.popitem(last=False)
            self.round_trip.pop(old, None)
            self.cohort.pop(old, None)

    def prune(self, alive: Callable[[Hashable], bool]) -> int:
        """Forget every session ``alive`` says has ended (its request will not be answered:
        a cohort would wait the whole window for it each time); returns how many."""
        gone = [tag for tag in self.round_trip.keys() | self.sent_at.keys() if not alive(tag)]
        for tag in gone:
            self.forget(tag)
        return len(gone)

    def forget(self, tag: Hashable) -> None:
        """``tag``'s session has ended: its request, if out, will not be answered."""
        self.sent_at.pop(tag, None)
        self.round_trip.pop(tag, None)
        self.cohort.pop(tag, None)

    def arrived(self, tag: Hashable, at: float) -> tuple[Hashable, float] | None:
        """The next job of ``tag`` was queued at ``at``: learn its round trip. Returns (its
        cohort, when its request went out) for :meth:`due`, None when none was out or it had
        no cohort."""
        sent = self.sent_at.pop(tag, None)
        cohort = self.cohort.pop(tag, None)
        if sent is None:
            return None
        r = max(0.0, at - sent)
        previous = self.round_trip.get(tag)
        self.round_trip[tag] = r if previous is None else previous + _SMOOTHING * (r - previous)
        return None if cohort is None else (cohort, sent)

    def due(
        self, now: float, window: float, arrivals: Iterable[tuple[Hashable, float] | None] = ()
    ) -> tuple[int, float]:
        """(sessions whose verdict is due within ``window`` and not overdue, the latest due
        time among them); see :meth:`expected`."""
        expected = self.expected(now, window, arrivals)
        return len(expected), max([now, *expected.values()])

    def expected(
        self, now: float, window: float, arrivals: Iterable[tuple[Hashable, float] | None] = ()
    ) -> dict[Hashable, float]:
        """When each session whose verdict is due within ``window`` and not overdue is expected.
        ``arrivals`` (what :meth:`arrived` returned for the answers just taken): a request of
        one of their cohorts sent no later than that answer's is due now (expected by the
        window's end)."""
        sent_by: dict[Hashable, float] = {}
        for arrival in arrivals:
            if arrival is not None:
                cohort, sent = arrival
                sent_by[cohort] = max(sent, sent_by.get(cohort, sent))
        due: dict[Hashable, float] = {}
        for tag, sent in self.sent_at.items():
            cohort = self.cohort.get(tag)
            if cohort in sent_by and sent <= sent_by[cohort]:
                due[tag] = now + window
                continue
            r = self.round_trip.get(tag)
            if r is not None and now - _LATE * r <= sent + r <= now + window:
                due[tag] = sent + r
        return due

    def out(self, tag: Hashable) -> bool:
        """Whether ``tag``'s request is out (sent, not yet answered)."""
        return tag in self.sent_at
