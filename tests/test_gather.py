"""Gathering: a batch waits for the verdicts due within one batch's service time."""

from __future__ import annotations

import threading
import time

from starsd.gather import Returns
from starsd.hub.drafters.base import ChainState, DraftJob
from starsd.hub.engine import DraftingEngine
from starsd.hub.pacing import Pacer
from starsd.hub.policy import GammaPolicy
from starsd.hub.scheduler import FairQueue
from starsd.hub.sessions import Limits, SessionTable
from starsd.protocol import SamplingParams


def _engine(*open_tags: bytes) -> tuple[FairQueue[DraftJob], DraftingEngine]:
    """A drafting engine with no model or sender, its table holding sessions ``open_tags``
    (those still open): only its batching is exercised."""
    q: FairQueue[DraftJob] = FairQueue()
    limits = Limits(8, 8, 4, 8, lease_s=10.0, vocab_size=64, max_positions=None)
    table = SessionTable(limits)
    table.sessions.update((tag, None) for tag in open_tags)  # type: ignore[misc]
    engine = DraftingEngine(
        None,
        Pacer(GammaPolicy(), None),
        q,
        table,
        threading.Lock(),
        None,
        None,  # type: ignore[arg-type]
        max_batch=8,
    )
    return q, engine


def _one_forwards_verdicts(engine: DraftingEngine, q: FairQueue[DraftJob], out: tuple) -> list:
    """Sessions ``out`` had proposals out together from one target (a cohort, round trips of
    1 s learnt); the verdicts of a and b arrive now and 30 ms later. The batch drafted."""
    assert engine.returns is not None
    state = ChainState([1], SamplingParams(), 4, None)  # type: ignore[arg-type]
    now = time.perf_counter()
    for tag in out:
        engine.returns.sent(tag, now - 1.0)
        engine.returns.arrived(tag, now)  # R = 1 s: the next verdicts look 1 s away
        engine.returns.sent(tag, now, cohort=b"target")
    q.put(b"target", DraftJob(b"a", 1, state, 0, (), owner=b"target"))
    job_b = DraftJob(b"b", 1, state, 0, (), owner=b"target")
    threading.Timer(0.03, q.put, args=(b"target", job_b)).start()
    batch = engine._next_batch()
    assert batch is not None
    return batch


def test_due_counts_only_verdicts_expected_within_the_window() -> None:
    """Catches waiting for a session whose round trip is unknown, one already overdue (it may
    decode alone or be gone: every batch would wait the whole window for it), or one not due
    until after the window."""
    returns = Returns()
    for tag, sent, r in [(b"a", 0.0, 0.010), (b"b", 0.0, 0.030), (b"late", -1.0, 0.010)]:
        returns.sent(tag, sent - r)
        returns.arrived(tag, sent)  # learns R
        returns.sent(tag, sent)
    returns.sent(b"new", 0.0)  # no round trip yet
    assert returns.due(0.0, 0.020) == (1, 0.010)  # a: due at 10 ms; b: at 30 ms, too late
    assert returns.due(0.0, 0.040) == (2, 0.030)
    assert returns.due(0.012, 0.010)[0] == 1  # a 2 ms overdue: within 0.25 R, it counts
    assert returns.due(0.020, 0.005) == (0, 0.020)  # ... 10 ms overdue, it does not


def test_wait_for_wakes_on_the_count_or_gives_up_at_the_deadline() -> None:
    """Catches a wait that ignores new jobs (the batch waits the whole window) or that never
    ends without them (the hub hangs)."""
    q: FairQueue[int] = FairQueue()
    q.put("a", 1)
    threading.Timer(0.02, q.put, args=("b", 2)).start()
    started = time.perf_counter()
    q.wait_for(2, started + 5.0)
    assert len(q) == 2 and time.perf_counter() - started < 1.0
    started = time.perf_counter()
    q.wait_for(3, started + 0.05)
    assert 0.04 < time.perf_counter() - started < 1.0
    assert q.take(5) == [1, 2] and len(q) == 0


def test_a_job_due_shortly_joins_the_batch() -> None:
    """Catches an engine that drafts whatever waits the moment it is free, so targets split
    into groups that take turns (measured: batches of 1 and 31 alternating at N = 32)."""
    q, engine = _engine(b"a", b"b")
    assert engine.returns is not None
    engine.service_s = 0.5  # one batch's service time: the longest worth waiting
    state = ChainState([1], SamplingParams(), 4, None)  # type: ignore[arg-type]
    now = time.perf_counter()
    for tag in (b"a", b"b"):
        engine.returns.sent(tag, now - 0.05)
        engine.returns.arrived(tag, now)  # R = 50 ms
    engine.returns.sent(b"b", now)  # b's verdict is due at now + 50 ms
    q.put("a", DraftJob(b"a", 1, state, 0, ()))
    threading.Timer(0.03, q.put, args=("b", DraftJob(b"b", 1, state, 0, ()))).start()
    batch = engine._next_batch()
    assert batch is not None and [job.tag for job in batch] == [b"a", b"b"]
    assert time.perf_counter() - now < 0.4  # it came early: no wait for the deadline


def test_a_cohorts_requests_sent_with_an_answer_are_due_now() -> None:
    """Catches a hub that trusts each session's round trip for requests verified in one target
    forward (their R swings with the forward's rows, so it drafted one forward's verdicts in two
    batches), or that waits for a cohort's request sent after the answer (its target verifies
    it in a later forward), for another cohort's, or for a request re-sent without one."""
    returns = Returns()
    for tag in (b"a", b"b", b"x"):  # round trips of 150 ms, learnt
        returns.sent(tag, -0.15)
        returns.arrived(tag, 0.0)
    returns.sent(b"a", 0.0, cohort="t")
    returns.sent(b"b", 0.0, cohort="t")  # drafted with a: verified with it
    returns.sent(b"later", 0.005, cohort="t")  # drafted after: a later forward
    returns.sent(b"x", 0.0, cohort="u")  # another target
    returns.sent(b"moved", 0.0, cohort="t")
    returns.sent(b"moved", 0.0)  # sent again without a cohort: it is in none
    arrival = returns.arrived(b"a", 0.1)  # a forward of 100 ms: R predicted 150
    assert arrival == ("t", 0.0)
    assert returns.due(0.1, 0.01) == (0, 0.1)  # by round trips alone: nobody is due
    assert returns.due(0.1, 0.01, [arrival]) == (1, 0.1 + 0.01)  # b: due now, wait the window
    assert returns.due(0.1, 0.01, [None]) == (0, 0.1)  # an answer without a cohort


def test_a_targets_verdicts_on_one_forward_are_drafted_in_one_batch() -> None:
    """Catches the engine splitting one target's verdicts over two batches when its round
    trips mispredict them (each batch then costs its own service time)."""
    q, engine = _engine(b"a", b"b")
    engine.service_s = 0.2
    started = time.perf_counter()
    batch = _one_forwards_verdicts(engine, q, (b"a", b"b"))
    assert [job.tag for job in batch] == [b"a", b"b"]
    assert time.perf_counter() - started < 0.15  # it came early: no wait for the deadline


def test_a_session_closed_with_its_proposal_out_is_not_waited_for() -> None:
    """Catches a hub that keeps counting a session its target closed (a sequence that ended)
    among its cohort's due verdicts: every batch of that target then waited the whole window
    (measured: 10.5 ms of the 24 ms between a target's forwards at --concurrency 8 on the real
    pair). Also that the ended session's round trip is forgotten, not kept for good."""
    q, engine = _engine(b"a", b"b")  # "ended" is no longer in the table
    engine.service_s = 0.5
    started = time.perf_counter()
    batch = _one_forwards_verdicts(engine, q, (b"a", b"b", b"ended"))
    assert [job.tag for job in batch] == [b"a", b"b"]
    assert time.perf_counter() - started < 0.3  # b came: nothing else is due, no wait for "ended"
    assert engine.returns is not None and b"ended" not in engine.returns.round_trip


def test_prune_forgets_ended_sessions_only() -> None:
    """Catches a prune that drops live sessions (their round trips relearnt, batches split) or
    keeps an ended one's round trip (the table grows with every session ever served)."""
    returns = Returns()
    for tag in (b"live", b"ended", b"ended-out"):
        returns.sent(tag, 0.0, cohort="t")
        returns.arrived(tag, 0.1)
    returns.sent(b"live", 0.2, cohort="t")
    returns.sent(b"ended-out", 0.2, cohort="t")
    assert returns.prune(lambda tag: tag == b"live") == 2
    assert set(returns.round_trip) == {b"live"} and set(returns.sent_at) == {b"live"}
    assert returns.cohort == {b"live": "t"}
