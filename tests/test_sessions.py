"""The hub's session table and admission rules, without sockets, threads or a model.

Each test names the bug it catches. The clock is injected, so leases are tested exactly.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from starsd.hub.sessions import Limits, Peer, Refused, SessionTable
from starsd.protocol import Draft, ErrorCode, Open, SamplingParams

PROMPT = np.array([5, 17, 33, 8], dtype=np.int32)
LIMITS = Limits(
    max_sessions=3,
    max_sessions_per_target=2,
    default_gamma=4,
    max_gamma=8,
    lease_s=3.0,
    vocab_size=100,
    max_positions=64,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(limits: Limits = LIMITS) -> tuple[SessionTable, Clock]:
    clock = Clock()
    return SessionTable(limits, clock), clock


def _state(prompt: list[int], params: SamplingParams, gamma: int) -> dict:
    return {"prompt": prompt, "gamma": gamma}


def _peer(table: SessionTable, rid: bytes, key: bytes | None = None) -> Peer:
    peer = table.welcome(rid, key or rid, rid.hex())
    assert peer is not None
    return peer


def _open(
    table: SessionTable,
    peer: Peer,
    prompt: np.ndarray = PROMPT,
    gamma: int = 0,
    features: np.ndarray | None = None,
) -> bytes:
    msg = Open(1, prompt, SamplingParams(), gamma, features=features)
    return table.open(peer, msg, _state).tag


def _refused(code: str, call, *args) -> Refused:
    with pytest.raises(Refused) as info:
        call(*args)
    assert info.value.code == code, info.value
    return info.value


def _snapshot(table: SessionTable) -> tuple:
    sessions = {t: copy.copy(vars(s)) for t, s in table.sessions.items()}
    return sessions, {r: set(p.tags) for r, p in table.peers.items()}


def test_open_uses_the_default_gamma_and_an_unguessable_tag() -> None:
    """Catches: gamma 0 (use the hub's default) not resolved; tags reused or short."""
    table, _ = _table()
    peer = _peer(table, b"A")
    tags = {_open(table, peer), _open(table, peer)}
    assert len(tags) == 2 and all(len(t) == 16 for t in tags)
    assert {s.state["gamma"] for s in table.sessions.values()} == {LIMITS.default_gamma}
    assert peer.tags == tags and peer.stats.sessions == 2


def test_under_auto_an_open_naming_a_gamma_keeps_it() -> None:
    """Catches --gamma auto taking over a session whose OPEN named a gamma, a fixed hub gamma
    (--gamma N) left to the policy, an auto session that does not start at the default, and
    an OPEN above max_gamma accepted because the hub chooses anyway."""
    table, _ = _table(Limits(**{**vars(LIMITS), "auto_gamma": True}))
    peer = _peer(table, b"A")
    auto, named = _open(table, peer), _open(table, peer, gamma=3)
    assert not table.sessions[auto].gamma_fixed and table.sessions[auto].state["gamma"] == 4
    assert table.sessions[named].gamma_fixed and table.sessions[named].state["gamma"] == 3
    other = _peer(table, b"B")  # (A holds its quota of 2)
    for bad in (9, -1):
        _refused(ErrorCode.INVALID_ARGUMENT, _open, table, other, PROMPT, bad)
    fixed, _ = _table(Limits(**{**vars(LIMITS), "default_gamma": 0}))  # --gamma 0
    session = fixed.sessions[_open(fixed, _peer(fixed, b"A"))]
    assert session.gamma_fixed and session.state["gamma"] == 0


def test_a_verdict_on_a_span_alone_counts_as_a_gamma_0_round() -> None:
    """Catches a span alone (a proposal of 0 tokens) counted as a speculative round (it would
    dilute mean_accepted and the hub's STATS rounds), or accepting drafts it never had."""
    table, _ = _table()
    peer = _peer(table, b"A")
    tag = _delivered_session(table, peer, proposed=0)
    span = np.arange(10, 15, dtype=np.int32)
    _refused(ErrorCode.INVALID_ARGUMENT, table.draft, peer, Draft(tag, 1, 1, span))
    session, answered = table.draft(peer, Draft(tag, 1, 0, span))
    assert session.length == len(PROMPT) + 5 and answered == 0
    assert (peer.stats.rounds, peer.stats.alone_rounds) == (0, 1)
    table.delivered(tag, 1, 4)
    assert table.draft(peer, Draft(tag, 2, 2, span[:1]))[1] == 4  # the proposal it answers
    assert (peer.stats.rounds, peer.stats.alone_rounds, peer.stats.proposed) == (1, 1, 4)
    assert "gamma=2.00 gamma0=0.500" in peer.stats.line()


@pytest.mark.parametrize(
    "case",
    ["draining", "hub full", "target quota", "gamma", "empty", "token id", "features unwanted"],
)
def test_each_open_refusal_changes_nothing(case: str) -> None:
    """Catches: a refusal that still allocates a session or a tag, or the wrong error code."""
    table, _ = _table()
    a, b = _peer(table, b"A"), _peer(table, b"B")
    _open(table, a)
    if case == "hub full":
        _open(table, b), _open(table, _peer(table, b"C"))
    if case == "target quota":
        _open(table, a)
    table.draining = case == "draining"
    before = _snapshot(table)
    args = {
        "gamma": (PROMPT, 9, None),
        "empty": (PROMPT[:0], 0, None),
        "token id": (np.array([100], dtype=np.int32), 0, None),
        "features unwanted": (PROMPT, 0, np.zeros((3, 8), np.float16)),
    }.get(case, (PROMPT, 0, None))
    code = {
        "draining": ErrorCode.SHUTTING_DOWN,
        "hub full": ErrorCode.RESOURCE_EXHAUSTED,
        "target quota": ErrorCode.RESOURCE_EXHAUSTED,
    }.get(case, ErrorCode.INVALID_ARGUMENT)
    refusal = _refused(code, _open, table, a, *args)
    assert refusal.ref == 1 and _snapshot(table) == before


def test_feature_rules_for_an_eagle_hub() -> None:
    """Catches: features of the wrong shape, dtype or with NaN reaching the drafter."""
    table, _ = _table(Limits(**{**vars(LIMITS), "feature_width": 8}))
    peer = _peer(table, b"A")
    good = np.zeros((3, 8), np.float16)  # one row per prompt token but the last
    for bad in (None, good[:2], good.astype(np.float32), np.full((3, 8), np.nan, np.float16)):
        _refused(ErrorCode.INVALID_ARGUMENT, _open, table, peer, PROMPT, 0, bad)
    assert not table.sessions
    _open(table, peer, features=good)


def _delivered_session(table: SessionTable, peer: Peer, proposed: int = 4) -> bytes:
    tag = _open(table, peer)
    assert table.delivered(tag, 0, proposed) is not None
    return tag


def test_a_verdict_is_applied_once_and_in_order() -> None:
    """Catches: a replayed or reordered DRAFT applied twice; BUSY not enforced; accepted
    beyond the proposal taken; a verdict counted although it was refused."""
    table, _ = _table()
    peer = _peer(table, b"A")
    tag = _open(table, peer)
    draft = Draft(tag, 0, 0, np.array([3], dtype=np.int32))
    _refused(ErrorCode.BUSY, table.draft, peer, draft)  # its first proposal is being drafted
    table.delivered(tag, 0, 4)
    _refused(ErrorCode.OUT_OF_ORDER, table.draft, peer, draft)  # seq 0 was the OPEN's
    _refused(ErrorCode.INVALID_ARGUMENT, table.draft, peer, Draft(tag, 1, 5, draft.appended))
    assert peer.stats.rounds == 0
    session, _ = table.draft(peer, Draft(tag, 1, 2, draft.appended))
    assert session.in_flight and peer.stats.rounds == 1 and peer.stats.accepted == 2
    _refused(ErrorCode.BUSY, table.draft, peer, Draft(tag, 1, 2, draft.appended))
    table.delivered(tag, 1, 3)
    _refused(ErrorCode.OUT_OF_ORDER, table.draft, peer, Draft(tag, 1, 2, draft.appended))
    assert peer.stats.rounds == 1 and session.next_seq == 2 and session.last_gamma == 3


def test_an_error_result_keeps_the_sequence_number() -> None:
    """Catches: an ERROR delivery (e.g. CONTEXT_FULL) advancing next_seq like a proposal."""
    table, _ = _table()
    peer = _peer(table, b"A")
    tag = _delivered_session(table, peer)
    table.draft(peer, Draft(tag, 1, 0, PROMPT[:1]))
    session = table.delivered(tag, 1, None)
    assert session is not None and session.next_seq == 1 and not session.in_flight


def test_foreign_and_unknown_tags() -> None:
    """Catches: a target drafting or closing another target's session."""
    table, _ = _table()
    owner, intruder = _peer(table, b"A"), _peer(table, b"B")
    tag = _delivered_session(table, owner)
    before = _snapshot(table)
    for call, arg in ((table.draft, Draft(tag, 1, 0, PROMPT[:1])), (table.close, tag)):
        _refused(ErrorCode.FORBIDDEN, call, intruder, arg)
    assert _snapshot(table) == before
    _refused(ErrorCode.UNKNOWN_SESSION, table.close, owner, b"\0" * 16)
    table.close(owner, tag)
    assert not table.sessions and not owner.tags


def test_a_reconnected_owner_takes_its_sessions_along() -> None:
    """Catches: proposals still routed to the dead connection after the same key reconnects."""
    table, _ = _table()
    old, new = _peer(table, b"A1", key=b"K"), _peer(table, b"A2", key=b"K")
    tag = _delivered_session(table, old)
    table.draft(new, Draft(tag, 1, 0, PROMPT[:1]))
    assert table.sessions[tag].routing_id == b"A2" and new.tags == {tag} and not old.tags


def test_closed_while_drafting_delivers_nothing() -> None:
    """Catches: a proposal sent for a session that was closed while its job was drafted."""
    table, _ = _table()
    peer = _peer(table, b"A")
    tag = _open(table, peer)
    table.close(peer, tag)
    assert table.delivered(tag, 0, 4) is None


def test_leases_follow_the_clock() -> None:
    """Catches: a lease that never expires, expires early, or is not renewed by traffic."""
    table, clock = _table()
    quiet, busy = _peer(table, b"Q"), _peer(table, b"B")
    _open(table, quiet)
    clock.now += LIMITS.lease_s
    assert table.expired() == []  # exactly at the lease: still alive
    table.seen(busy)
    clock.now += 0.01
    assert table.expired() == [quiet]
    assert len(table.forget(quiet)) == 1 and not table.sessions and b"Q" not in table.peers
    assert table.welcome(b"B", b"B", "again") is None  # a known connection is not re-admitted


def test_the_quota_counts_a_key_over_all_its_connections() -> None:
    """Catches: a quota per connection, which one key on several connections multiplies."""
    table, _ = _table(Limits(**{**vars(LIMITS), "max_sessions": 100}))
    conns = [_peer(table, bytes([i]), key=b"K") for i in range(3)]
    _open(table, conns[0]), _open(table, conns[1])
    _refused(ErrorCode.RESOURCE_EXHAUSTED, _open, table, conns[2])
    table.close(conns[0], next(iter(conns[0].tags)))
    _open(table, conns[2])  # closing one frees its place in the key's quota


def test_a_nearly_full_hub_keeps_a_share_for_a_newcomer() -> None:
    """Catches: a few targets taking every session, so a target arriving later gets none."""
    limits = Limits(**{**vars(LIMITS), "max_sessions": 16, "max_sessions_per_target": 16})
    table, _ = _table(limits)
    greedy = _peer(table, b"G")
    opened = 0
    with pytest.raises(Refused) as info:
        while True:
            _open(table, greedy)
            opened += 1
    assert info.value.code == ErrorCode.RESOURCE_EXHAUSTED and opened < 16
    newcomer = _peer(table, b"N")
    _open(table, newcomer)  # still room, although the greedy target asked for everything
    _refused(ErrorCode.RESOURCE_EXHAUSTED, _open, table, greedy)


def test_context_full_is_refused_before_anything_changes() -> None:
    """Catches: a re-sent DRAFT after CONTEXT_FULL growing the session each time (the check
    ran after the tokens were appended, so nothing bounded the session's memory)."""
    table, _ = _table(Limits(**{**vars(LIMITS), "max_positions": 8}))
    peer = _peer(table, b"A")
    _refused(ErrorCode.CONTEXT_FULL, _open, table, peer, np.arange(8, dtype=np.int32))
    tag = _delivered_session(table, peer)  # 4 prompt tokens
    long_draft = Draft(tag, 1, 2, np.array([1, 2], dtype=np.int32))  # 4 + 2 + 2 = 8: full
    for _ in range(3):
        _refused(ErrorCode.CONTEXT_FULL, table.draft, peer, long_draft)
    assert table.sessions[tag].length == 4 and peer.stats.rounds == 0
    table.draft(peer, Draft(tag, 1, 2, np.array([1], dtype=np.int32)))
    assert table.sessions[tag].length == 7


def test_a_failed_job_ends_its_session() -> None:
    """Catches: a session kept after its drafting failed half-way (state no longer matches
    the target's tokens), so a retried DRAFT would commit the verdict twice."""
    table, _ = _table()
    peer = _peer(table, b"A")
    tag = _open(table, peer)
    assert table.delivered(tag, 0, None) is not None
    assert tag not in table.sessions and not peer.tags and not table.owned_by


@pytest.mark.parametrize("field", ["others_us", "forward_us"])
@pytest.mark.parametrize("value", [-1, 600_000_001])
def test_a_verdicts_times_outside_their_range_are_refused(field: str, value: int) -> None:
    """Catches a DRAFT's times taken as sent: a negative prefill time made a round trip longer
    than it was, one over the round trip made it negative, and either priced its target's
    gammas (a hostile target's own only, but refused with a reason rather than learnt)."""
    table, _ = _table()
    peer = _peer(table, b"A")
    tag = _open(table, peer)
    table.delivered(tag, 0, 4)
    appended = np.array([3], dtype=np.int32)
    error = _refused(
        ErrorCode.INVALID_ARGUMENT, table.draft, peer, Draft(tag, 1, 2, appended, **{field: value})
    )
    assert field in str(error) and peer.stats.rounds == 0
    session, _ = table.draft(peer, Draft(tag, 1, 2, appended, **{field: 600_000_000}))
    assert session.in_flight and peer.stats.rounds == 1
