"""The event outbox (agent/outbox.py): events raised before a client's data channel opens
wait for it, bounded and in order; a failing channel never breaks the sender."""

from __future__ import annotations

import asyncio
import json
import math
from typing import cast

import aiohttp
import pytest
from aiortc import RTCDataChannel

from agent.config import Config
from agent.hooks import SessionHooks
from agent.outbox import MAX_PENDING_EVENTS, MAX_UNACKED_EVENT_BYTES, EventOutbox, admit_speech
from agent.protocol import ProtocolError, Say, TextDelta
from agent.session import AgentSession
from signaling.keys import SESSIONS
from tests.conftest import LiveServer
from tests.doubles import ToneEngine
from tests.rtc_client import RtcClient


class FakeChannel:
    """Stands in for RTCDataChannel: its state, and the messages sent on it."""

    def __init__(self, state: str = "connecting", fail: bool = False) -> None:
        self._state = state
        self.fail = fail
        self.sent: list[dict[str, object]] = []
        self.state_reads = 0
        self.bufferedAmount = 0  # aiortc's name: bytes sent but not yet handed to SCTP

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
    assert MAX_PENDING_EVENTS == 128  # README: "up to 128 events"


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


def test_events_to_a_client_that_reads_nothing_are_dropped_past_a_bound() -> None:
    channel = FakeChannel("open")
    outbox = EventOutbox(expects_channel=True, owner="s")
    with_channel(outbox, channel)
    outbox.send({"type": "stats"})
    channel.bufferedAmount = MAX_UNACKED_EVENT_BYTES + 1
    outbox.send({"type": "stats"})
    assert (len(channel.sent), outbox.dropped) == (1, 1)
    channel.bufferedAmount = 0  # it reads again: events go out again
    outbox.send({"type": "speech.started", "id": "a"})
    assert channel.sent[-1] == {"type": "speech.started", "id": "a"}


async def test_a_client_that_stops_acknowledging_its_channel_does_not_grow_the_server(
    live_server: LiveServer,
) -> None:
    """A client stops acknowledging (SCTP SACK) what the server sends on its data channel
    but keeps sending: each refused message got an error event and a stats event went out
    every second, all queued by aiortc without a bound for as long as the client's RTCP
    kept the session alive (found by review: 3000 junk messages, 2000+ events queued). The
    outbox now drops events past 64 KiB waiting."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            assert client.session_id is not None
            peer = live_server.app[SESSIONS].get(client.session_id)

            async def no_sack() -> None:
                return None

            client.pc.sctp._send_sack = no_sack  # type: ignore[method-assign]
            for i in range(3_000):
                client.send("x" * 10)  # bad_json: one error event each
                if i % 100 == 0:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(1)
            outbox = peer.session.outbox
            assert outbox.dropped > 0
            assert outbox.channel is not None
            assert outbox.channel.bufferedAmount <= MAX_UNACKED_EVENT_BYTES + 1024
            assert len(peer.pc.sctp._data_channel_queue) <= 1_000
        finally:
            await client.close()


@pytest.mark.parametrize("wait", [0.25, 1.5])
def test_a_data_channel_request_refused_for_its_rate_says_when_to_retry(wait: float) -> None:
    """A speech request whose next token is a fraction of a second away is refused too
    (the burst is spent), its retry hint rounded up to whole seconds, as HTTP's
    Retry-After is; a text delta continuing a stream is never counted."""
    hooks = SessionHooks(admit_speech=lambda: wait)
    with pytest.raises(ProtocolError) as refused:
        admit_speech(Say("hello", None), lambda _id: True, hooks)
    assert refused.value.code == "rate_limited"
    assert f"retry in {math.ceil(wait)} s" in refused.value.message
    admit_speech(TextDelta("more", None), lambda _id: False, hooks)  # not refused


def test_a_stray_delta_of_a_refused_stream_does_not_refuse_the_next_one() -> None:
    """Stream x refused; the writer's stream y spoken; then a late delta of x (refused
    again, stream_refused) must not mark the writer's next id-less stream refused."""
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config())
    events: list[dict[str, object]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    session.handle_message(json.dumps({"type": "text.delta", "id": "x", "delta": 7}))
    for message in (
        {"type": "text.delta", "id": "y", "delta": "Stream y. "},
        {"type": "text.end"},
        {"type": "text.delta", "id": "x", "delta": "late x "},
        {"type": "text.delta", "delta": "An id-less stream. "},
    ):
        session.handle_message(json.dumps(message))
    codes = [e["code"] for e in events if e["type"] == "error"]
    session.pipeline.discard()
    assert codes == ["bad_message", "stream_refused"], codes
