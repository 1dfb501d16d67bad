"""The server-sent events parser (agent/sse.py) against the WHATWG standard's rules.

Bug: the LLM client read SSE line by line, each ``data:`` line an event of its own, so legal
streams failed or lost text: data over several lines (joined with LF), an empty ``data:``,
a leading BOM, bare-CR line ends. The rules here are the standard's "event stream
interpretation"; the same events must come out however the bytes are chunked.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.sse import SSEError, SSEParser

LIMIT = 1 << 10


def parse(*chunks: bytes, limit: int = LIMIT) -> list[str]:
    parser = SSEParser(limit, limit)
    events = [event.data for chunk in chunks for event in parser.feed(chunk)]
    return events + [event.data for event in parser.close()]


@pytest.mark.parametrize(
    ("stream", "events"),
    [
        # the standard's own examples
        (b"data: YHOO\ndata: +2\ndata: 10\n\n", ["YHOO\n+2\n10"]),
        (
            b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\n",
            [
                "first event",
                "second event",
            ],
        ),
        (b"data\n\ndata\ndata\n\n", ["", "\n"]),
        (b"data:test\n\ndata: test\n\n", ["test", "test"]),
        # one space after the colon goes, any other stays
        (b"data:  two spaces \n\n", [" two spaces "]),
        # other fields, comments and an event without data dispatch nothing
        (b"event: ping\nid: 7\nretry: 10\n\n: keep-alive\n\nfoo: bar\n\n", []),
        (b"event: message\ndata: x\n\n", ["x"]),
        # line ends: LF, CRLF, CR, mixed
        (b"data: a\r\ndata: b\r\n\r\n", ["a\nb"]),
        (b"data: a\rdata: b\r\rdata: c\n\n", ["a\nb", "c"]),
        # a BOM at the start of the stream is dropped; one anywhere else is data
        (b"\xef\xbb\xbfdata: a\n\ndata: \xef\xbb\xbfb\n\n", ["a", "\ufeffb"]),
        # invalid UTF-8 is replaced, not fatal
        (b"data: \xff\n\n", ["\ufffd"]),
        # the end of the stream: an event without its blank line is kept (lenient)
        (b"data: a\n\ndata: b", ["a", "b"]),
        (b"data: a\n", ["a"]),
        (b"", []),
    ],
)
def test_events_follow_the_standard(stream: bytes, events: list[str]) -> None:
    assert parse(stream) == events


def test_a_crlf_split_over_two_chunks_is_one_line_end() -> None:
    # Read as CR then LF, the LF would be a blank line: "a" and "b" two events.
    assert parse(b"data: a\r", b"\ndata: b\r\n\r", b"\n") == ["a\nb"]


def test_a_character_or_bom_split_over_chunks_is_whole() -> None:
    assert parse(b"\xef", b"\xbb", b"\xbfdata: \xc3", b"\xa9\n\n") == ["\u00e9"]


STREAM = (
    '\ufeffdata: {"a":\r\ndata: 1}\r\n\r\n: c\r\revent: e\rdata:é€😀\r\r'
    "data:\n\nid: 1\ndata: last\n\n"
).encode()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_chunking_gives_the_same_events(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in pairwise(points)]
    assert parse(*chunks) == ['{"a":\n1}', "é€😀", "", "last"]


def test_a_line_over_the_limit_is_an_error_even_without_its_end() -> None:
    parser = SSEParser(LIMIT, 10 * LIMIT)
    parser.feed(b"data: ")
    with pytest.raises(SSEError, match="line"):
        for _ in range(LIMIT):  # dribbled: no line end ever comes
            parser.feed(b"x")


def test_an_event_over_the_limit_is_an_error_even_in_short_lines() -> None:
    parser = SSEParser(LIMIT, 4 * LIMIT)
    line = b"data: " + b"x" * (LIMIT - 10) + b"\n"
    with pytest.raises(SSEError, match="event"):
        for _ in range(5):
            parser.feed(line)


@pytest.mark.parametrize(
    ("stream", "events"),
    [
        # the standard's event field names the type, until the event is dispatched
        (b"event: error\ndata: x\n\ndata: y\n\n", [("error", "x"), ("message", "y")]),
        # an event field with no data dispatches nothing, and names nothing after it
        (b"event: error\n\ndata: y\n\n", [("message", "y")]),
        # llama.cpp's server: an error after its 200 headers, as a field of its own
        (
            b'error: {"message":"m"}\n\ndata: [DONE]\n\n',
            [("error", '{"message":"m"}'), ("message", "[DONE]")],
        ),
    ],
)
def test_an_events_type_comes_with_its_data(stream: bytes, events: list[tuple[str, str]]) -> None:
    parser = SSEParser(LIMIT, LIMIT)
    got = [*parser.feed(stream), *parser.close()]
    assert [(event.type, event.data) for event in got] == events
