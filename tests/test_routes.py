"""edge.routes: which inbox a hub's message goes to, and what a session may still be sent."""

from __future__ import annotations

import asyncio

from edge.routes import SessionRoutes
from starsd.protocol import Error, ErrorCode, Opened


def _opened(routes: SessionRoutes, ref: int, tag: bytes) -> asyncio.Queue:
    routes.expect(ref)
    inbox = routes.open_session(ref, tag)
    assert inbox is not None
    return inbox


def test_a_session_gets_one_proposal_per_request_plus_its_pushed_branches() -> None:
    """Catches a credit that is not spent, or refilled past two requests' worth."""
    routes = SessionRoutes(push=2)
    _opened(routes, 1, b"t")
    assert [routes.spend(b"t") for _ in range(4)] == [True, True, True, False]
    for _ in range(5):  # a target that asks again and again before reading
        routes.grant(b"t", 1)
    assert sum(routes.spend(b"t") for _ in range(10)) == 6  # 2 x (1 + 2)


def test_an_opened_nobody_waits_for_or_a_second_one_is_not_routed() -> None:
    """Catches a hub re-routing a live session to another sequence with a second OPENED."""
    routes = SessionRoutes(push=0)
    assert routes.open_session(7, b"x") is None  # no OPEN 7
    first = _opened(routes, 1, b"t")
    routes.expect(2)
    assert routes.open_session(2, b"t") is None
    assert routes.inbox(b"t") is first
    assert routes.known(b"t")


def test_forgetting_a_session_drops_its_route_and_credit() -> None:
    """Catches proposals still delivered (or credited) to a closed sequence."""
    routes = SessionRoutes(push=1)
    _opened(routes, 1, b"t")
    routes.forget(b"t")
    assert routes.inbox(b"t") is None and not routes.known(b"t") and not routes.spend(b"t")
    assert len(routes) == 0


def test_unclaimed_openeds_are_forgotten_and_returned_for_closing() -> None:
    """Catches a session whose OPENED came as its caller gave up staying open on the hub."""
    routes = SessionRoutes(push=0)
    inbox = routes.expect(3)
    assert routes.open_session(3, b"late") is inbox
    inbox.put_nowait(Opened(3, b"late"))
    assert routes.unclaimed(inbox) == [b"late"]
    assert not routes.known(b"late") and inbox.empty()


def test_a_lost_hub_tells_every_waiter_and_voids_only_the_sessions() -> None:
    """Catches a sequence left waiting on a dead hub, or an OPEN's route dropped with the
    sessions (its caller still waits for an answer to it)."""
    routes = SessionRoutes(push=0)
    session = _opened(routes, 1, b"t")
    opening = routes.expect(2)
    routes.void("hub down")
    for inbox, ref, tag in ((session, None, b"t"), (opening, 2, None)):
        msg = inbox.get_nowait()
        assert isinstance(msg, Error) and msg.code == ErrorCode.NOT_WELCOMED
        assert (msg.ref, msg.tag) == (ref, tag)
    assert routes.inbox(b"t") is None and routes.inbox(2) is opening and len(routes) == 0
