"""Committed token ids -> text deltas that never change once sent, with ``stop`` strings.

A token can end inside a multi-byte character (byte-level BPE splits emoji and CJK across
tokens); its decoded text then ends in U+FFFD until the next token completes it. Text is emitted
only once it is stable: the window ``ids[prefix:]`` is decoded and compared with the text of
``ids[prefix:read]`` already sent (the offsets scheme of TGI and vLLM), so the deltas joined are
``decode(ids)``, as a non-streamed response has it.

``stop`` strings follow the OpenAI API: generation ends at the first occurrence of any of them and
the text returned stops before it. Text that could be the start of a stop string is held back
until the next tokens show it is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]
REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


class TextStream:
    """Text of one sequence's committed tokens, delivered as append-only deltas."""

    def __init__(self, decode: Decode, stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.prefix = 0  # decoding window start: a few tokens back, for context-dependent merges
        self.read = 0  # tokens whose text is in ``self.text``
        self.text = ""  # stable text so far (stop string and what follows removed)
        self.sent = 0  # characters of ``self.text`` already handed out
        self.stopped = False  # a stop string was found: nothing more is produced

    def push(self, ids: Sequence[int]) -> str:
        """Append committed ``ids``; returns the text that became safe to send."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        window = self.decode(self.ids[self.prefix :])
        done = self.decode(self.ids[self.prefix : self.read])
        if len(window) > len(done) and not window.endswith(REPLACEMENT):
            self.text += window[len(done) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest once the sequence has ended (an incomplete character is sent as it is)."""
        if not self.stopped:
            whole = self.decode(self.ids)
            # Decoding the whole can differ from the windows only in the unfinished tail.
            self.text += whole[len(self.text) :] if whole.startswith(self.text) else ""
            self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stops and not self.stopped:
            self._cut_at_stop()
        hold = 0 if final or self.stopped else self._held_back()
        end = max(self.sent, len(self.text) - hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def _cut_at_stop(self) -> None:
        # A stop string can straddle what was sent and the new text: search from just before.
        start = max(0, self.sent - max(len(s) for s in self.stops) + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string."""
        tail = self.text[self.sent :]
        for n in range(min(len(tail), max((len(s) for s in self.stops), default=0)), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0
