"""Where each message from one hub goes, and what each of its sessions may still be sent.

A sequence waits on its inbox. Until the hub answers its OPEN the inbox is known by the OPEN's
``ref`` (OPENED and errors before a tag exists carry it); from the OPENED on, by the session's
tag, with a credit: the proposals the hub may still send that session (one per request, plus
the pushed branches the target asked for). A proposal beyond its credit is not delivered.

Owned by the event loop, like the :class:`edge.client.HubClient` that holds it: nothing here
is locked.
"""

from __future__ import annotations

import asyncio
import contextlib

from starsd import protocol
from starsd.protocol import Error, ErrorCode, Opened

INBOX_LIMIT = 16  # messages waiting for one sequence (beyond: dropped, the hub is over-sending)

Inbox = asyncio.Queue[protocol.Message]


class SessionRoutes:
    """The inboxes of one hub connection's sequences, by ref or tag, and each session's credit."""

    def __init__(self, push: int) -> None:
        self._push = push  # the pushed branches this target asks for per request
        self._inboxes: dict[int | bytes, Inbox] = {}
        self._credit: dict[bytes, int] = {}

    def __len__(self) -> int:
        """Open sessions (what the hub's read budget grows with)."""
        return len(self._credit)

    def expect(self, ref: int) -> Inbox:
        """A new inbox for the answer to the OPEN ``ref``."""
        inbox: Inbox = asyncio.Queue(INBOX_LIMIT)
        self._inboxes[ref] = inbox
        return inbox

    def open_session(self, ref: int, tag: bytes) -> Inbox | None:
        """Route ``tag`` to the inbox that waited on ``ref``, with a request's credit; None when
        nobody waits (the OPEN timed out) or the tag is already routed (a second OPENED)."""
        inbox = self._inboxes.pop(ref, None)
        if inbox is None or tag in self._inboxes:
            return None
        self._inboxes[tag] = inbox
        self._credit[tag] = 1 + self._push
        return inbox

    def known(self, tag: bytes) -> bool:
        """Whether ``tag`` is a session of this target's (routed or still owed proposals)."""
        return tag in self._inboxes or tag in self._credit

    def spend(self, tag: bytes) -> bool:
        """Take one proposal from ``tag``'s credit; False when it has none left."""
        credit = self._credit.get(tag, 0)
        if credit <= 0:
            return False
        self._credit[tag] = credit - 1
        return True

    def grant(self, tag: bytes, proposals: int) -> None:
        """What the hub may send ``tag`` for one request: ``proposals`` and the branches the
        session asked for (at most two requests' worth outstanding)."""
        if tag in self._credit:
            allowance = 1 + self._push
            self._credit[tag] = min(2 * allowance, self._credit[tag] + proposals + self._push)

    def inbox(self, key: int | bytes) -> Inbox | None:
        """The inbox of the OPEN ``key`` (int) or the session ``key`` (bytes), if routed."""
        return self._inboxes.get(key)

    def forget(self, key: int | bytes) -> None:
        """Stop routing ``key``: its sequence has its answer, or has ended."""
        self._inboxes.pop(key, None)
        if isinstance(key, bytes):
            self._credit.pop(key, None)

    def unclaimed(self, inbox: Inbox) -> list[bytes]:
        """The tags of sessions whose OPENED reached ``inbox`` but not its caller (it timed out
        or was cancelled at that moment), forgotten here: the caller must CLOSE them."""
        tags = []
        while not inbox.empty():
            msg = inbox.get_nowait()
            if isinstance(msg, Opened):
                self.forget(msg.tag)
                tags.append(msg.tag)
        return tags

    def void(self, why: str) -> None:
        """The hub is down: tell every waiting sequence (it re-opens elsewhere or decodes
        alone), and drop this generation's sessions, their credit and their routes."""
        for key, inbox in self._inboxes.items():
            tag, ref = (key, None) if isinstance(key, bytes) else (None, key)
            with contextlib.suppress(asyncio.QueueFull):  # (a full inbox: it reads ``up``)
                inbox.put_nowait(Error(ErrorCode.NOT_WELCOMED, why, ref=ref, tag=tag))
        self._credit.clear()
        self._inboxes = {k: q for k, q in self._inboxes.items() if not isinstance(k, bytes)}
