"""The event outbox (agent/outbox.py): events raised before a client's data channel opens
wait for it, bounded and in order; a failing channel never breaks the sender."""

from __future__ import annotations

import json
from typing import cast

from aiortc import RTCDataChannel

from agent.outbox import MAX_PENDING_EVENTS, EventOutbox


class FakeChannel:
    """Stands in for RTCDataChannel: its state, and the messages sent on it."""

    def __init__(self, state: str = "connecting", fail: bool = False) -> None:
        self._state = state
        self.fail = fail
        self.sent: list[dict[str, object]] = []
        self.state_reads = 0

    @property
    def readyState(self) -> str:  # aiortc's name
        self.state_reads += 1
        assert self.state_reads < 10_000, "the outbox keeps polling a closed channel"
        return self._state

    def open(self) -> None:
        self._state = "open"

    def send(self, data: str) -> None:
        if self.fail:
            raise ConnectionError("transport closed")
        self.sent.append(json.loads(data))


def with_channel(outbox: EventOutbox, channel: FakeChannel) -> None:
    outbox.channel = cast(RTCDataChannel, channel)


def test_events_before_the_channel_opens_are_delivered_in_order_once_it_does() -> None:
    outbox = EventOutbox(expects_channel=True, owner="test")
    outbox.send({"type": "a"})  # no channel at all yet
    channel = FakeChannel()
    with_channel(outbox, channel)
    outbox.send({"type": "b"})  # a channel, not open yet
    outbox.flush()  # nothing to do until it opens (and no busy loop)
    assert channel.sent == []
    channel.open()
    outbox.flush()
    outbox.send({"type": "c"})
    assert [e["type"] for e in channel.sent] == ["a", "b", "c"]
    outbox.flush()
    assert len(channel.sent) == 3  # sent once each


def test_pending_events_are_bounded_and_the_oldest_go_first() -> None:
    outbox = EventOutbox(expects_channel=True, owner="test")
    for i in range(MAX_PENDING_EVENTS + 5):
        outbox.send({"type": "n", "i": i})
    channel = FakeChannel("open")
    with_channel(outbox, channel)
    outbox.flush()
    assert [e["i"] for e in channel.sent] == list(range(5, MAX_PENDING_EVENTS + 5))


def test_without_an_expected_channel_nothing_is_kept() -> None:
    """A WHEP listener never opens a data channel: its events must not pile up."""
    outbox = EventOutbox(expects_channel=False, owner="test")
    outbox.send({"type": "speech.started"})
    channel = FakeChannel("open")
    with_channel(outbox, channel)
    outbox.flush()
    assert channel.sent == []


def test_a_failing_channel_drops_the_event_without_raising() -> None:
    outbox = EventOutbox(expects_channel=True, owner="test")
    channel = FakeChannel("open", fail=True)
    with_channel(outbox, channel)
    outbox.send({"type": "speech.ended"})  # e.g. from a playout mark: must not raise
    channel.fail = False
    outbox.send({"type": "next"})
    assert [e["type"] for e in channel.sent] == ["next"]
