"""A room as a joiner and /metrics see it: what it starts from, and counts that last."""

from __future__ import annotations

import json
from typing import Any

from agent.config import Config
from agent.outbox import MAX_PENDING_EVENTS
from agent.room import Room
from agent.speech import Event
from tests.doubles import ToneEngine


def msg(**fields: Any) -> str:
    return json.dumps(fields)


class OpenChannel:
    """A data channel that is open and records what is sent."""

    readyState = "open"
    bufferedAmount = 0

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, data: str) -> None:
        self.sent.append(json.loads(data))


async def test_room_state_says_the_agent_is_speaking_only_while_it_is_heard() -> None:
    """The agent's speaker.active is active from speech.started to speech.ended (README).
    room.state's agent_speaking was True while a text stream was merely open (nothing
    generated, no speech.started sent to anyone): a joiner was told the agent talked while
    everyone else had it silent, until that stream was spoken."""
    room = Room("r", ToneEngine(), Config())
    writer = room.join("sa", speaking=False, host=True, expects_channel=False)
    sent: list[Event] = []
    writer.outbox.send = sent.append  # type: ignore[method-assign]
    writer.handle_message(msg(type="text.delta", id="s", delta="Still typing"))
    assert not [e for e in sent if e["type"] == "error"], sent
    # Nobody has heard anything: no speech.started, the agent is not active for the writer.
    assert not [e for e in sent if e["type"] in ("speech.started", "speaker.active")]
    assert room.pipeline.audible is None
    joiner = room.join("sb", speaking=False, host=True, expects_channel=False)
    state = room.describe(joiner)
    try:
        assert state["agent_speaking"] is False, state
    finally:
        await room.leave(joiner)
        await room.leave(writer)


async def test_a_joiners_room_state_survives_events_before_its_channel_opens() -> None:
    """Events raised before a participant's data channel opens wait in a queue of 128 that
    drops the oldest: room.state (the participant list, its own id, who may instruct) was
    the first event, so a busy room pushed it out and the client never learnt who is in
    the room. It is kept apart now, and sent first."""
    room = Room("r", ToneEngine(), Config())
    late = room.join("late", speaking=False, host=True, expects_channel=True)
    other = room.join("other", speaking=False, host=True, expects_channel=False)
    try:
        for _ in range(MAX_PENDING_EVENTS):  # e.g. others muting, talking, joining
            room.broadcast({"type": "participant.updated", **other.describe()})
        channel = OpenChannel()
        late.outbox.channel = channel  # type: ignore[assignment]
        late.outbox.flush()
        kinds = [e["type"] for e in channel.sent]
        assert kinds[0] == "room.state" and len(kinds) == 1 + MAX_PENDING_EVENTS, kinds[:3]
    finally:
        await room.leave(other)
        await room.leave(late)


async def test_a_rooms_counters_never_go_down_while_a_participant_is_still_joining() -> None:
    """The room's counters were kept only when the session leaving was its last member. A
    member still joining (admitted by the room, not yet registered: its ICE gathering takes
    a while) counted as another one, but /metrics read rooms only through registered
    sessions: the last registered one leaving made the room's underruns vanish from the
    totals (a counter going down), for good once the joining one failed. Rooms are read
    from the room registry now, and kept as they close."""
    from prometheus_client.parser import text_string_to_metric_families

    from signaling.metrics import Metrics
    from signaling.rooms import RoomRegistry

    metrics = Metrics(ToneEngine(), 10)
    registry = RoomRegistry(Config(), ToneEngine(), on_closed=metrics.retire_room)
    metrics.watch(tuple, rooms=registry.rooms)

    def underruns() -> float:
        return next(
            s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples
            if s.name == "voice_agent_underruns_total"
        )

    def join(session_id: str) -> Any:
        options = {"speaking": False, "host": True, "display_name": None, "hooks": None}
        return registry.join("r", session_id, expects_channel=False, **options)

    present, joining = join("s1"), join("s2")
    room = registry.get("r")
    assert room is not None
    room.pipeline.buffer.underruns = 3
    assert underruns() == 3
    await room.leave(present)
    assert underruns() == 3  # the room lives on with the one still joining
    await room.leave(joining)  # its offer failed: the room closes with it
    assert registry.get("r") is None
    assert underruns() == 3
