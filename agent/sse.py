"""An incremental parser of server-sent events, as the WHATWG HTML standard defines them.

Neither aiohttp nor another dependency parses SSE on the client side, and reading the stream
line by line is not enough: an event's ``data`` may span several ``data:`` lines (joined
with ``\\n``), lines may end in CR, LF or CRLF, and the stream may start with a BOM.
Bytes go in as they arrive, in chunks of any size (split mid-line, mid-CRLF or mid-UTF-8
character); each event's data comes out once its blank line has arrived.

A chat completion stream needs an event's ``data`` and its type (``event``): ``error``
says the server failed after its 200 headers. llama.cpp's server writes such an error as a
field of its own (``error: {...}``, no ``data``), which is read as ``event: error`` with that
data. ``id`` and ``retry`` (a browser's EventSource reconnecting) and ``:`` comments are
skipped. Everything is bounded: a line or an event's data longer than its limit is an
``SSEError``.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

_LINE_END = re.compile(r"\r\n|\r|\n")


class SSEError(ValueError):
    """The stream broke a bound (a line or an event too large)."""


@dataclass(frozen=True)
class SSEEvent:
    data: str
    type: str = "message"  # the standard's default when no ``event`` field names it


class SSEParser:
    def __init__(self, max_line: int, max_event: int) -> None:
        # utf-8-sig drops the one BOM the standard allows at the start of the stream, even
        # when it arrives split over chunks; errors="replace" as the standard decodes.
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
        self._max_line = max_line
        self._max_event = max_event
        # The line so far, as parts: joining on every chunk would be quadratic in the length
        # of a line a server dribbles out.
        self._line: list[str] = []
        self._line_len = 0
        self._after_cr = False  # the last chunk ended in CR: an LF opening the next ends no line
        self._data: list[str] | None = None  # the event's data lines; None: no data field yet
        self._data_len = 0
        self._type = ""  # the event's ``event`` field

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Each event that this chunk completes."""
        return self._text(self._decoder.decode(chunk))

    def close(self) -> list[SSEEvent]:
        """The end of the stream: an event still open.

        The standard drops an event not closed by a blank line; it is kept here, as the
        line-based reader this replaced did, for servers that end on a bare ``data:`` line."""
        events = self._text(self._decoder.decode(b"", final=True))
        if self._line:
            self._end_line(events)
        self._end_line(events)  # a blank line: dispatch whatever is open
        return events

    def _text(self, text: str) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        if not text:  # e.g. a chunk that is only part of a UTF-8 character
            return events
        start = 0
        if self._after_cr and text[0] == "\n":
            start = 1
        for end in _LINE_END.finditer(text, start):
            self._add(text[start : end.start()])
            self._end_line(events)
            start = end.end()
        self._add(text[start:])
        # A CR at the very end may be the first half of a CRLF split over two chunks.
        self._after_cr = text.endswith("\r")
        return events

    def _add(self, part: str) -> None:
        if not part:
            return
        self._line_len += len(part)
        if self._line_len > self._max_line:
            raise SSEError(f"a line longer than {self._max_line} characters")
        self._line.append(part)

    def _end_line(self, events: list[SSEEvent]) -> None:
        line = "".join(self._line)
        self._line.clear()
        self._line_len = 0
        if not line:  # a blank line dispatches the event
            if self._data is not None:
                events.append(SSEEvent("\n".join(self._data), self._type or "message"))
            self._data = None
            self._data_len = 0
            self._type = ""
            return
        if line.startswith(":"):
            return  # a comment (': keep-alive')
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]  # one space after the colon is not part of the value
        if field == "event":
            self._type = value[: self._max_line]
            return
        if field == "error":  # llama.cpp's: an error event, its data on this line
            self._type = "error"
        elif field != "data":
            return  # id, retry and unknown fields: nothing a completion needs
        if self._data is None:
            self._data = []
        self._data_len += len(value) + 1
        if self._data_len > self._max_event:
            raise SSEError(f"an event larger than {self._max_event} characters")
        self._data.append(value)
