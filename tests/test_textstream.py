"""edge.textstream: streamed text deltas are final, join to decode(all), and honour ``stop``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from edge.textstream import TextStream

# A byte-level "tokenizer": each id is one byte; decoding replaces broken UTF-8 with U+FFFD,
# as byte-level BPE decoders do.
TEXT = "naïve café: 日本語 ok 🎉!"
IDS = list(TEXT.encode())


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _stream(ids: list[int], chunks: list[int], stops: tuple[str, ...] = ()) -> list[str]:
    text = TextStream(decode, stops)
    out, at = [], 0
    for size in chunks:
        out.append(text.push(ids[at : at + size]))
        at += size
        if text.stopped:
            break
    out.append(text.finish())
    return out


def test_a_character_split_across_tokens_is_sent_only_once_complete() -> None:
    """Bug caught: sending U+FFFD for half a character (a client can never take it back)."""
    deltas = _stream(IDS, [1] * len(IDS))
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == TEXT


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=40))
def test_joined_deltas_equal_the_decoded_whole_for_any_chunking(chunks: list[int]) -> None:
    """Bug caught: text lost or doubled at a window boundary, whatever the rounds commit."""
    chunks = [*chunks, len(IDS)]
    assert "".join(_stream(IDS, chunks)) == TEXT


def test_an_unfinished_character_at_the_end_is_flushed_by_finish() -> None:
    """Bug caught: the tail of a sequence cut by max_tokens inside a character was dropped."""
    ids = list("ok 🎉".encode())[:-1]
    assert "".join(_stream(ids, [1] * len(ids))) == decode(ids)


def test_stop_string_is_trimmed_at_its_first_occurrence_even_across_chunks() -> None:
    """Bug caught: a stop string split over two rounds, or text after it, reaching the client."""
    ids = list(b"alpha STOP beta STOP gamma")
    deltas = _stream(ids, [3, 5, 2, 30], stops=("STOP",))
    assert "".join(deltas) == "alpha "


def test_text_that_may_begin_a_stop_string_is_held_back_then_released() -> None:
    """Bug caught: 'ST' sent before knowing it is not the start of 'STOP'."""
    text = TextStream(decode, ("STOP",))
    assert text.push(list(b"a ST")) == "a "
    assert text.push(list(b"ART")) == "START"
    assert text.finish() == ""
    assert not text.stopped


def test_the_earliest_of_several_stop_strings_wins() -> None:
    """Bug caught: stopping at the first stop string in the list rather than in the text."""
    deltas = _stream(list(b"one two three"), [13], stops=("three", "two"))
    assert "".join(deltas) == "one "
