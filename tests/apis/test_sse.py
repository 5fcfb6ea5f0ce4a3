"""The SSE event framer: whole events out, byte for byte, whatever the cuts (LF and CRLF)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.apis.sse import EventFramer, end_of_last_event, split_events

LF_EVENTS = [b'data: {"a": 1}\n\n', b"event: message_start\ndata: {}\n\n", b"data: [DONE]\n\n"]
CRLF_EVENTS = [b'data: {"a": 1}\r\n\r\n', b"event: x\r\ndata: {}\r\n\r\n", b"data: [DONE]\r\n\r\n"]
MIXED_EVENTS = [b"data: a\n\r\n", b"data: b\r\n\n", b": comment\n\n"]


def frame_all(pieces: list[bytes]) -> tuple[list[bytes], EventFramer]:
    framer = EventFramer()
    return [framer.feed(piece) for piece in pieces], framer


def cut(data: bytes, points: list[int]) -> list[bytes]:
    points = sorted(set(points))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@pytest.mark.parametrize("events", [LF_EVENTS, CRLF_EVENTS, MIXED_EVENTS], ids=["lf", "crlf", "mixed"])
def test_every_cut_gives_back_the_same_bytes_in_whole_events(events: list[bytes]) -> None:
    whole = b"".join(events)
    ends = {len(b"".join(events[:i])) for i in range(1, len(events) + 1)}
    for point in range(1, len(whole)):
        out, framer = frame_all(cut(whole, [point]))
        assert b"".join(out) == whole and not framer.holding, point
        sent = 0
        for piece in out:  # every write ends exactly at an event end, never inside one
            sent += len(piece)
            assert not piece or sent in ends, (point, piece)


def test_no_byte_goes_out_before_its_event_ends() -> None:
    """The relay's old `_frame` cut at rfind(end) + 2 == 1 when no end was buffered: one byte
    of an unfinished event went out, and a broken stream then showed `d\\n\\ndata: {"error"`."""
    framer = EventFramer()
    assert framer.feed(b"data: {") == b""
    assert framer.holding
    assert framer.feed(b'"x": 1}\n') == b""
    assert framer.feed(b"\n") == b'data: {"x": 1}\n\n'
    assert not framer.holding


def test_crlf_events_go_out_as_they_end_not_at_the_end_of_the_stream() -> None:
    """CRLF-framed events never matched the old b"\\n\\n": all of them piled up in the held
    tail (copied again on every chunk) and the stream ended as broken."""
    framer = EventFramer()
    for event in CRLF_EVENTS:
        assert framer.feed(event) == event
    assert framer.feed(b"data: x\r\n\r") == b""
    assert framer.feed(b"\ndata: y") == b"data: x\r\n\r\n"
    assert framer.holding


def test_a_long_event_in_tiny_pieces_is_held_as_pieces() -> None:
    framer = EventFramer()
    payload = b"data: " + b"x" * 200_000
    for i in range(0, len(payload), 7):
        assert framer.feed(payload[i:i + 7]) == b""
    assert len(framer._held) > 20_000  # kept as it came: not one growing copy per piece
    assert framer.feed(b"\r\n\r\n") == payload + b"\r\n\r\n"


@given(st.lists(st.sampled_from(LF_EVENTS + CRLF_EVENTS + MIXED_EVENTS), min_size=1, max_size=12),
       st.integers(min_value=0, max_value=2**32))
def test_random_streams_cut_anywhere(events: list[bytes], seed: int) -> None:
    whole = b"".join(events)
    rng = random.Random(seed)
    points = rng.sample(range(1, len(whole)), min(len(whole) - 1, rng.randint(0, 30)))
    out, framer = frame_all(cut(whole, points))
    assert b"".join(out) == whole and not framer.holding
    assert split_events(b"".join(out)) == events


def test_split_events_leaves_an_unfinished_event_out() -> None:
    assert split_events(b"data: a\n\ndata: b\r\n\r\ndata: c") == [b"data: a\n\n", b"data: b\r\n\r\n"]


# --- generated events: any lines, any mix of LF and CRLF, keep-alives, one-byte fields ------

_LINE_END = st.sampled_from([b"\n", b"\r\n"])
_LINE = st.one_of(
    st.sampled_from([b":", b": keep-alive", b"data: [DONE]", b"d"]),
    st.text(st.characters(blacklist_characters="\r\n", codec="utf-8"), min_size=1, max_size=12)
    .map(str.encode),
)
# An event: one or more non-empty lines, each with its line end, then the blank line's end.
EVENTS = st.builds(lambda lines, end: b"".join(line + eol for line, eol in lines) + end,
                   st.lists(st.tuples(_LINE, _LINE_END), min_size=1, max_size=4), _LINE_END)


@settings(max_examples=150, deadline=None)
@given(st.lists(EVENTS, min_size=1, max_size=8), st.data())
def test_generated_events_come_out_whole_and_one_by_one(events: list[bytes], data) -> None:
    whole = b"".join(events)
    points = data.draw(st.lists(st.integers(1, max(1, len(whole) - 1)), max_size=12)) \
        if len(whole) > 1 else []
    out, framer = frame_all(cut(whole, points))
    assert b"".join(out) == whole and not framer.holding
    ends = {len(b"".join(events[:i])) for i in range(1, len(events) + 1)}
    sent = 0
    for piece in out:  # every write ends exactly at an event end
        sent += len(piece)
        assert not piece or sent in ends
    assert split_events(whole) == events


def test_a_short_event_after_a_keep_alive_is_its_own_event() -> None:
    assert split_events(b":\n\nd\r\n\r\n") == [b":\n\n", b"d\r\n\r\n"]
    assert split_events(b":\r\n\r\nd\n\n") == [b":\r\n\r\n", b"d\n\n"]


def test_the_last_event_end_is_the_one_that_ends_furthest() -> None:
    assert end_of_last_event(b"a\r\n\r\nb\n\n") == 8
    assert end_of_last_event(b"a\n\nb\r\n\r\n") == 8
    assert end_of_last_event(b"a\n\nb", start=3) == -1
    assert end_of_last_event(b"a\n\nb\n\n", start=3) == 6


def test_flush_gives_the_unfinished_event_and_starts_afresh() -> None:
    framer = EventFramer()
    assert framer.feed(b"data: a\n\ndata: b") == b"data: a\n\n"
    assert framer.flush() == b"data: b"
    assert not framer.holding and framer.flush() == b""
    assert framer.feed(b"data: c\n\n") == b"data: c\n\n"


def test_an_event_end_at_the_very_start_counts() -> None:
    """A stray blank line opening a stream (or a chunk) is an end like any other: the framer
    passes it at once rather than holding it with the next event."""
    assert end_of_last_event(b"\n\nda") == 2
    assert split_events(b"\n\ndata: a\n\n") == [b"\n\n", b"data: a\n\n"]
    framer = EventFramer()
    assert framer.feed(b"\r\n\r\nda") == b"\r\n\r\n"
    assert framer.feed(b"ta\n\n") == b"data\n\n"


def test_a_short_piece_keeps_its_bytes_for_the_event_end() -> None:
    framer = EventFramer()
    assert framer.feed(b"d\n") == b""
    assert framer.feed(b"\n") == b"d\n\n"
    assert framer.feed(b"a\r\n") == b""
    assert framer.feed(b"\r\n") == b"a\r\n\r\n"


def test_flush_joins_the_held_pieces_as_they_came() -> None:
    framer = EventFramer()
    for piece in (b"da", b"ta: ", b"x"):
        assert framer.feed(piece) == b""
    assert framer.flush() == b"data: x"
