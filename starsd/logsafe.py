"""Log lines that a peer cannot forge or flood: escape what peers send, throttle what repeats.

Both sides log strings that came over the wire (a model name in HELLO, an ERROR's message).
Written verbatim, a newline or an ANSI escape in them forges log lines or rewrites a terminal;
:func:`printable` escapes and caps them. :class:`Throttle` keeps a line that an attacker can
trigger at will (a dropped reply, a flood refusal) to one per interval, with a count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MAX_LOGGED_CHARS = 120


def printable(text: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """``text`` with every non-printable character escaped, cut to ``limit`` characters."""
    raw = text if isinstance(text, str) else repr(text)
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in raw)
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."


class Throttle:
    """Lets one event per ``interval_s`` through per key, counting those held back.

    Not thread-safe: each owner keeps its own (the hub's under its lock).
    """

    def __init__(
        self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._next: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def allow(self, key: object) -> int | None:
        """None to stay quiet; else the number of events held back since the last one let
        through (0 the first time)."""
        now = self.clock()
        if now < self._next.get(key, float("-inf")):
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._next) > 10_000:  # keys are peer-chosen: bound the table
            self._next.clear()
        self._next[key] = now + self.interval_s
        return self._held.pop(key, 0)
