"""Events to a client's data channel, and the rule for admitting speech requests.

Shared by 1:1 sessions (agent/session.py) and room members (agent/room.py), which differ in
what they do with a message, not in how events reach the client or how speech is admitted.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Callable

from aiortc import RTCDataChannel

from agent.hooks import SessionHooks
from agent.protocol import (
    Chat,
    Message,
    ProtocolError,
    Say,
    TextDelta,
    answered_id,
    listen_on_channel,
)
from agent.speech import Event, SpeechError

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 128  # events raised before the data channel opened
# Events sent but not yet handed to SCTP (the channel's bufferedAmount) beyond which
# further events are dropped: aiortc queues what its SCTP cannot send yet without a bound,
# and for a client that stops acknowledging (while its RTCP keeps the session alive) every
# event (a stats event a second, an error per refused message) was queued for the whole
# session. 64 KiB is minutes of events for a client that reads nothing; a slow network's
# backlog is a few KiB.
MAX_UNACKED_EVENT_BYTES = 64 * 1024


def error_event(code: str, message: str, request_id: str | None = None) -> Event:
    """An ``error`` event; it carries the request's ``id`` when the request had one."""
    event: Event = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        event["id"] = request_id
    return event


class EventOutbox:
    """One client's events: sent on its data channel once open; those raised before wait
    (bounded, oldest dropped), unless no channel is expected (a WHEP listener has none)."""

    def __init__(self, expects_channel: bool, owner: str) -> None:
        self.channel: RTCDataChannel | None = None
        self._expects_channel = expects_channel
        self._pending: deque[Event] = deque(maxlen=MAX_PENDING_EVENTS)
        self._first: Event | None = None  # send_first's, waiting: never dropped
        self._owner = owner  # for the log
        self.dropped = 0  # events dropped for a client that does not read its channel

    @property
    def open(self) -> bool:
        return self.channel is not None and self.channel.readyState == "open"

    def attach(self, channel: RTCDataChannel, on_message: Callable[[str | bytes], None]) -> None:
        self.channel = channel
        listen_on_channel(channel, self.flush, on_message)

    def send(self, event: Event) -> None:
        channel = self.channel
        if channel is None or channel.readyState != "open":
            if self._expects_channel:
                self._pending.append(event)
            return
        if channel.bufferedAmount > MAX_UNACKED_EVENT_BYTES:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "%s: the client acknowledges nothing on its data channel (%d bytes "
                    "waiting): events are dropped until it does",
                    self._owner,
                    channel.bufferedAmount,
                )
            return
        try:
            channel.send(json.dumps(event))
        except Exception as exc:  # noqa: BLE001 - a closing transport must not break playout
            log.debug("%s: event dropped (%s)", self._owner, exc)

    def send_first(self, event: Event) -> None:
        """An event the client starts from (a room's ``room.state``): sent before the
        events raised while its channel was not open, and never dropped for them."""
        if self.open or not self._expects_channel:
            self.send(event)
        else:
            self._first = event

    def flush(self) -> None:
        if self._first is not None and self.open:
            first, self._first = self._first, None
            self.send(first)
        while self._pending and self.open:
            self.send(self._pending.popleft())


def refusal(
    message: Message | None,
    exc: ProtocolError | SpeechError,
    refuse_rest: Callable[[str | None], None],
) -> str | None:
    """What refusing ``message`` leaves behind; returns the id its error carries. A text
    delta's (parsed or malformed) refuses the rest of its stream (``refuse_rest``), unless
    the refusal is that very rule (``stream_refused``)."""
    request_id = answered_id(message, exc)
    is_delta = isinstance(message, TextDelta) or getattr(exc, "message_type", None) == "text.delta"
    if is_delta and exc.code != "stream_refused":
        refuse_rest(request_id)
    return request_id


def admit_speech(
    message: Message, opens_stream: Callable[[str | None], bool], hooks: SessionHooks
) -> None:
    """Rate-limit requests that start speech; a refused one is an error, nothing else.

    A text delta counts only when it opens a stream (``opens_stream``): an LLM streams many
    deltas per second, and one stream's total is already capped by ``max_text_chars``.
    """
    match message:
        case Say() | Chat():
            pass
        case TextDelta(id=utt_id) if opens_stream(utt_id):
            pass
        case _:
            return
    wait = hooks.admit_speech()
    if wait > 0:
        raise ProtocolError(
            "rate_limited", f"too many speech requests; retry in {math.ceil(wait)} s"
        )
