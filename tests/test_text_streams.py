"""Text streams have one writer: a client, a brain reply, a room participant.

Only the writer of the open stream may continue or end it. Before this, a stray ``text.end``
or id-less delta cut or joined whichever stream was open (a brain reply's, another room
participant's), and an interrupted reply's clean-up ended the client's next stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agent.config import Config, SpeechSettings
from agent.conversation_config import ServiceSettings
from agent.engine import EngineError, VoiceOptions
from agent.llm import Message
from agent.room import MUTE_ANNOUNCE_INTERVAL_S, Room, RoomMember
from agent.session import AgentSession
from agent.speech import SpeechError, SpeechPipeline
from tests.doubles import FailingEngine, ToneEngine
from tests.services import FakeLLM
from tests.test_speech_pipeline import Drain, wait_for

Event = dict[str, Any]


class SlowBrain:
    """An LLM-like brain: its reply's pieces arrive ``delay`` seconds apart."""

    name = "slow"

    def __init__(self, deltas: list[str], delay: float = 0.05) -> None:
        self.deltas = deltas
        self.delay = delay

    async def reply(self, history: list[Message]) -> AsyncIterator[str]:
        for delta in self.deltas:
            await asyncio.sleep(self.delay)
            yield delta


REPLY = ["One two three. ", "Four five six. ", "Seven."]


def make_session(brain: SlowBrain) -> tuple[AgentSession, list[Event], Drain]:
    session = AgentSession("s", ToneEngine(seconds_per_word=0.05), Config())
    events: list[Event] = []
    session.outbox.send = events.append  # type: ignore[method-assign]
    session.conversation._brain = brain
    session.pipeline.start()
    return session, events, Drain(session.pipeline)


def msg(**fields: Any) -> str:
    return json.dumps(fields)


def of(events: list[Event], kind: str, utterance_id: str | None = None) -> list[Event]:
    return [
        e for e in events if e["type"] == kind and (utterance_id is None or e["id"] == utterance_id)
    ]


def spoken(events: list[Event]) -> list[str]:
    return [e["text"] for e in of(events, "speech.segment")]


def balanced(events: list[Event]) -> None:
    """Every utterance started once and ended once, in that order."""
    starts = [e["id"] for e in of(events, "speech.started")]
    ends = [e["id"] for e in of(events, "speech.ended")]
    assert len(starts) == len(set(starts)), starts
    assert sorted(starts) == sorted(ends), (starts, ends)


def pipeline(events: list[Event], engine: ToneEngine | None = None) -> SpeechPipeline:
    p = SpeechPipeline(engine or ToneEngine(seconds_per_word=0.05), SpeechSettings(), events.append)
    p.start()
    return p


def members(room: Room, *sessions: str) -> list[tuple[RoomMember, list[Event]]]:
    """Room hosts joined under these session ids, each with the events sent to it."""
    joined = []
    for session_id in sessions:
        member = room.join(session_id, speaking=False, host=True, expects_channel=False)
        sent: list[Event] = []
        member.outbox.send = sent.append  # type: ignore[method-assign]
        joined.append((member, sent))
    return joined


# --- the pipeline ----------------------------------------------------------------------------
async def test_only_the_writer_continues_or_ends_its_stream() -> None:
    events: list[Event] = []
    p = pipeline(events)
    drain = Drain(p)
    assert p.opens_stream(None, owner="A")
    p.text_delta("One two. ", "a", owner="A")
    assert not p.opens_stream(None, owner="B")
    with pytest.raises(SpeechError) as refused:
        p.text_end(owner="B")
    assert refused.value.code == "no_stream"
    with pytest.raises(SpeechError) as refused:
        p.text_delta("Intruder. ", owner="B")  # no id: would have joined A's stream
    assert refused.value.code == "stream_open"
    assert p.text_delta("Three four.", owner="A") == "a"  # the writer, id-less: continues
    assert p.text_end(owner="A") == "a"
    await wait_for(lambda: of(events, "speech.ended"))
    drain.stop()
    await p.close()
    assert [(e["type"], e["id"]) for e in events if e["type"] != "speech.segment"] == [
        ("speech.started", "a"),
        ("speech.ended", "a"),
    ]
    assert spoken(events) == ["One two.", "Three four."]


async def test_an_interrupted_stream_discards_only_its_writers_deltas() -> None:
    events: list[Event] = []
    p = pipeline(events)
    drain = Drain(p)
    p.text_delta("First writer. ", "a", owner="A")
    p.interrupt()
    # B is not A: B's id-less delta opens B's stream instead of being thrown away as A's.
    assert p.opens_stream(None, owner="B") and not p.opens_stream(None, owner="A")
    b = p.text_delta("Second writer. ", owner="B")
    assert b is not None and b != "a"
    assert p.text_delta("rest of A", owner="A") is None  # A's remainder: dropped
    assert p.text_end(owner="A") is None  # A's end forgets A's stream, leaves B's open
    assert p.text_delta("Still B.", owner="B") == b
    assert p.text_end(owner="B") == b
    await wait_for(lambda: of(events, "speech.ended", b))
    drain.stop()
    await p.close()
    assert spoken(events) == ["Second writer.", "Still B."]
    assert [e["interrupted"] for e in of(events, "speech.ended")] == [True, False]


async def test_say_with_nothing_to_speak_is_refused() -> None:
    events: list[Event] = []
    p = pipeline(events)
    with pytest.raises(SpeechError) as refused:
        p.say("\u201d\u201d\u201d")  # closing quotes only: no segment to synthesize
    assert refused.value.code == "empty_text"
    assert not p.busy
    await p.close()


class FailsOn(ToneEngine):
    """Fails on any segment containing ``word``, before producing audio."""

    def __init__(self, word: str) -> None:
        super().__init__(seconds_per_word=0.05)
        self.word = word

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncIterator[Any]:
        if self.word in text:
            raise EngineError(f"cannot say {text!r}")
        async for chunk in super().synthesize(text, voice, continuation=continuation):
            yield chunk


async def test_no_caption_for_a_segment_the_engine_never_spoke() -> None:
    events: list[Event] = []
    p = pipeline(events, FailsOn("Two"))
    drain = Drain(p)
    p.say("One. Two three four.", "a")
    await wait_for(lambda: of(events, "speech.ended"))
    drain.stop()
    await p.close()
    assert spoken(events) == ["One."]  # not "Two three four.", which was never heard
    assert [e["code"] for e in of(events, "error")] == ["tts_failed"]
    assert of(events, "speech.ended")[0]["interrupted"] is True


# --- a session: the client and the brain's replies -------------------------------------------
async def test_a_cancelled_reply_does_not_end_the_clients_next_stream() -> None:
    session, events, drain = make_session(SlowBrain(REPLY))
    session.handle_message(msg(type="chat", text="hello"))
    await wait_for(lambda: of(events, "speech.started"))  # the reply's stream is open
    # The client barges in and streams its own text at once (one SCTP packet).
    session.handle_message(msg(type="interrupt"))
    session.handle_message(msg(type="text.delta", id="x", delta="Alpha beta. "))
    await asyncio.sleep(0.05)  # the cancelled reply's clean-up runs meanwhile
    session.handle_message(msg(type="text.delta", id="x", delta="Gamma delta. "))
    session.handle_message(msg(type="text.end"))
    await wait_for(lambda: of(events, "speech.ended", "x"))
    drain.stop()
    await session.close()
    assert len(of(events, "speech.started", "x")) == 1  # one utterance, not two
    assert [e["text"] for e in of(events, "speech.segment", "x")] == ["Alpha beta.", "Gamma delta."]
    assert not of(events, "error")
    balanced(events)


async def test_after_barge_in_the_clients_id_less_stream_is_not_thrown_away() -> None:
    session, events, drain = make_session(SlowBrain(REPLY))
    session.handle_message(msg(type="chat", text="hello"))
    await wait_for(lambda: of(events, "speech.started"))
    session.handle_message(msg(type="interrupt"))
    session.handle_message(msg(type="text.delta", delta="Alpha beta. "))
    await asyncio.sleep(0.05)
    session.handle_message(msg(type="text.delta", delta="Gamma delta. "))
    session.handle_message(msg(type="text.end"))
    await wait_for(lambda: len(of(events, "speech.ended")) == 2)
    drain.stop()
    await session.close()
    assert "Alpha beta." in spoken(events) and "Gamma delta." in spoken(events)
    assert not of(events, "error")
    balanced(events)


async def test_a_client_cannot_end_or_join_the_brains_reply() -> None:
    session, events, drain = make_session(SlowBrain(REPLY))
    session.handle_message(msg(type="chat", text="hello"))
    await wait_for(lambda: of(events, "speech.started"))
    session.handle_message(msg(type="text.end"))
    session.handle_message(msg(type="text.delta", delta="Intruder. "))
    await wait_for(lambda: of(events, "speech.ended"))
    drain.stop()
    await session.close()
    assert [e["code"] for e in of(events, "error")] == ["no_stream", "stream_open"]
    (started,) = of(events, "speech.started")  # one reply, one utterance
    reply_id = started["id"]
    assert [e["text"] for e in of(events, "speech.segment", reply_id)] == [
        "One two three.",
        "Four five six.",
        "Seven.",
    ]
    assert "Intruder." not in spoken(events)
    history = session.conversation.history
    assert history[-1] == {"role": "assistant", "content": "One two three. Four five six. Seven."}
    balanced(events)


async def test_a_reply_cancelled_while_waiting_leaves_no_history_slot() -> None:
    session, _events, drain = make_session(SlowBrain(["One two. ", "Three."], delay=0.2))
    session.handle_message(msg(type="chat", text="first"))
    session.handle_message(msg(type="chat", text="second"))  # waits for the first reply
    await asyncio.sleep(0.05)
    session.handle_message(msg(type="interrupt"))
    await wait_for(lambda: all(t.done() for t in session.conversation._reply_tasks))
    drain.stop()
    await session.close()
    assert session.conversation.history == [
        {"role": "user", "content": "first"},
        {"role": "user", "content": "second"},
    ]


async def test_chat_requests_are_bounded_like_say() -> None:
    session, events, drain = make_session(SlowBrain(["One. "], delay=5.0))
    limit = session.config.speech.max_queued_utterances
    for i in range(limit + 10):
        session.handle_message(msg(type="chat", text=f"question {i}"))
    pending = [t for t in session.conversation._reply_tasks if not t.done()]
    codes = [e["code"] for e in of(events, "error")]
    drain.stop()
    await session.close()
    assert len(pending) == limit
    assert codes == ["queue_full"] * 10
    # A refused chat is not in the history either (no question left unanswered).
    asked = [m["content"] for m in session.conversation.history if m["role"] == "user"]
    assert asked[-1] == f"question {limit - 1}"


# --- a room: one stream at a time, each participant's own ------------------------------------
async def test_a_room_participant_cannot_end_or_join_anothers_stream() -> None:
    room = Room("r", ToneEngine(seconds_per_word=0.05), Config())
    a = room.join("sa", speaking=False, host=True, expects_channel=False)
    b = room.join("sb", speaking=False, host=True, expects_channel=False)
    sent: dict[str, list[Event]] = {"a": [], "b": []}
    a.outbox.send = sent["a"].append  # type: ignore[method-assign]
    b.outbox.send = sent["b"].append  # type: ignore[method-assign]
    a.handle_message(msg(type="text.delta", id="s", delta="From A. "))
    b.handle_message(msg(type="text.end"))
    b.handle_message(msg(type="text.delta", delta="From B. "))
    assert [e["code"] for e in of(sent["b"], "error")] == ["no_stream", "stream_open"]
    assert not of(sent["a"], "error")
    assert room.pipeline.queued == 1 and not room.pipeline.opens_stream(
        None, owner=a.participant_id
    )
    # A leaves mid-stream: the stream ends (what A sent is spoken), B may open the next one.
    await room.leave(a)
    # B's refused stream is dropped up to its end (never spoken from its middle): once B
    # ends it, B may open the next one.
    assert not room.pipeline.opens_stream(None, owner=b.participant_id)
    b.handle_message(msg(type="text.end"))
    assert room.pipeline.opens_stream(None, owner=b.participant_id)
    b.handle_message(msg(type="text.delta", delta="Now B. "))
    assert not of(sent["b"], "error")[2:]
    assert room.pipeline.queued == 2
    await room.leave(b)


async def test_a_deeply_nested_room_message_is_bad_json_not_internal() -> None:
    room = Room("r", ToneEngine(), Config())
    member = room.join("s", speaking=False, host=True, expects_channel=False)
    sent: list[Event] = []
    member.outbox.send = sent.append  # type: ignore[method-assign]
    member.handle_message('{"type":"mute","x":' + "[" * 5000 + "]" * 5000 + "}")
    assert [e["code"] for e in of(sent, "error")] == ["bad_json"]
    await room.leave(member)


async def test_each_writer_keeps_its_own_interrupted_stream() -> None:
    # A's stream is interrupted, then B's: A's remainder must still be dropped after B's
    # end (one remembered stream for all writers let A's tail through).
    events: list[Event] = []
    p = pipeline(events)
    p.text_delta("A speaks. ", "a", owner="A")
    p.interrupt()
    p.text_delta("B speaks. ", "b", owner="B")
    p.interrupt()
    assert p.text_end(owner="B") is None  # B's clean-up
    assert p.text_delta("rest of A. ", owner="A") is None  # still A's remainder: dropped
    assert not p.opens_stream(None, owner="A")
    assert p.text_end(owner="A") is None
    assert p.opens_stream(None, owner="A")  # after its end, A may stream again
    await p.close()


async def test_a_chat_and_an_interrupt_in_one_batch_leave_nothing_behind() -> None:
    session, _events, drain = make_session(SlowBrain(REPLY))
    session.handle_message(msg(type="chat", text="hello"))
    session.handle_message(msg(type="interrupt"))  # before the reply task's first step
    await asyncio.sleep(0.05)
    conversation = session.conversation
    assert conversation.history == [{"role": "user", "content": "hello"}]  # no empty slot
    assert not conversation._unopened  # nothing counted against the chat limit
    drain.stop()
    await session.close()


async def test_a_streaming_reply_counts_once_against_the_chat_limit() -> None:
    session, events, drain = make_session(SlowBrain(REPLY, delay=0.3))
    limit = session.config.speech.max_queued_utterances
    session.handle_message(msg(type="chat", text="first"))
    # Its stream is open and being spoken (not still queued for the pipeline's runner to
    # take up: then it is waiting too, and 31 more reach the limit).
    await wait_for(lambda: session.pipeline.busy and session.pipeline.queued == 0)
    for i in range(limit):
        session.handle_message(msg(type="chat", text=f"question {i}"))
    # The streaming reply is the utterance being spoken, not a waiting one (as for say):
    # 32 wait behind it, at the limit, not over.
    assert not of(events, "error")
    session.handle_message(msg(type="chat", text="one too many"))
    assert [e["code"] for e in of(events, "error")] == ["queue_full"]
    drain.stop()
    await session.close()


async def test_a_reply_waits_for_the_clients_open_stream_instead_of_failing() -> None:
    """A chat asked while the client's own text stream was open failed with stream_open (the
    reply is a text stream too) and was never answered: it now waits for that stream's end,
    as a say queues behind it."""
    session, events, drain = make_session(SlowBrain(REPLY, delay=0.01))
    session.handle_message(msg(type="text.delta", id="mine", delta="My own words. "))
    session.handle_message(msg(type="chat", text="a question"))
    await asyncio.sleep(0.3)  # the brain has its answer ready by now
    assert not of(events, "error")
    session.handle_message(msg(type="text.end"))
    await wait_for(lambda: len(of(events, "speech.ended")) == 2, timeout=10)
    assert spoken(events) == ["My own words.", "One two three.", "Four five six.", "Seven."]
    assert not of(events, "error")
    balanced(events)
    drain.stop()
    await session.close()


async def test_a_streamed_llm_reply_waiting_for_the_clients_stream_does_not_time_out() -> None:
    """Bug: the same wait with the real LLM client failed the reply with llm_timeout once
    it exceeded --llm-timeout: the time the reply waited to be spoken was counted against
    the server, whose whole answer had arrived. The user heard its first fragment only."""
    async with FakeLLM() as llm:
        assert isinstance(llm, FakeLLM)
        llm.replies.append(["One two three. ", "Four five six."])
        services = ServiceSettings(llm_base_url=llm.url, llm_timeout_s=0.3)
        config = dataclasses.replace(Config(), services=services)
        session = AgentSession("s", ToneEngine(seconds_per_word=0.02), config)
        events: list[Event] = []
        session.outbox.send = events.append  # type: ignore[method-assign]
        session.pipeline.start()
        drain = Drain(session.pipeline)
        try:
            session.handle_message(msg(type="text.delta", id="mine", delta="My own words. "))
            session.handle_message(msg(type="chat", text="a question"))
            await asyncio.sleep(0.5)  # the client's stream stays open past the timeout
            session.handle_message(msg(type="text.end"))
            await wait_for(lambda: len(of(events, "speech.ended")) == 2, timeout=10)
            assert not of(events, "error"), of(events, "error")
            assert spoken(events) == ["My own words.", "One two three.", "Four five six."]
        finally:
            drain.stop()
            await session.close()


async def test_a_room_chat_waits_for_another_participants_stream() -> None:
    """The same in a room: a chat while a participant streams text was refused for everyone
    (stream_open) and never answered; a participant who leaves mid-stream frees it too."""
    room = Room("r", ToneEngine(seconds_per_word=0.02), Config())
    room.start()
    a = room.join("sa", speaking=False, host=True, expects_channel=False)
    b = room.join("sb", speaking=False, host=True, expects_channel=False)
    sent: list[Event] = []
    b.outbox.send = sent.append  # type: ignore[method-assign]
    try:
        a.handle_message(msg(type="text.delta", id="a1", delta="Hello everyone, "))
        b.handle_message(msg(type="chat", text="What is two plus two?"))
        await asyncio.sleep(0.3)
        assert not of(sent, "error")
        await room.leave(a)  # mid-stream: its stream ends, and the reply may start
        await wait_for(lambda: len(of(sent, "speech.ended")) == 2, timeout=10)
        assert spoken(sent) == ["Hello everyone,", "What is two plus two?"]  # echo brain
        assert not of(sent, "error")
    finally:
        await room.close()


async def test_a_repeated_mute_tells_the_room_only_of_a_change() -> None:
    """``mute`` broadcasts participant.updated when the muted flag changes; sending the same
    value again (a client re-syncing its button) says nothing new to the room."""
    room = Room("r", ToneEngine(), Config())
    a = room.join("sa", speaking=False, host=True, expects_channel=False)
    b = room.join("sb", speaking=False, host=True, expects_channel=False)
    sent: list[Event] = []
    b.outbox.send = sent.append  # type: ignore[method-assign]
    for muted in (True, True, False, False):
        a.handle_message(msg(type="mute", muted=muted))
    await asyncio.sleep(MUTE_ANNOUNCE_INTERVAL_S + 0.1)  # the change after the first waits
    updates = of(sent, "participant.updated")
    assert [e["muted"] for e in updates] == [True, False]
    await room.leave(a)
    await room.leave(b)


async def test_a_mute_flood_is_told_to_the_room_as_its_latest_state() -> None:
    """Every change of a participant's mute was broadcast to every participant at once: a
    client toggling it as fast as its channel goes had the room's CPU spent on its flood.
    Changes are now told at most every 0.2 s, the latest state winning."""
    room = Room("r", ToneEngine(), Config())
    a = room.join("sa", speaking=False, host=True, expects_channel=False)
    b = room.join("sb", speaking=False, host=True, expects_channel=False)
    sent: list[Event] = []
    b.outbox.send = sent.append  # type: ignore[method-assign]
    try:
        for i in range(1001):
            a.handle_message(msg(type="mute", muted=i % 2 == 0))  # ends muted
        assert [e["muted"] for e in of(sent, "participant.updated")] == [True]
        a.handle_message(msg(type="mute", muted=False))
        await asyncio.sleep(MUTE_ANNOUNCE_INTERVAL_S + 0.1)
        assert [e["muted"] for e in of(sent, "participant.updated")] == [True, False]
        a.handle_message(msg(type="mute", muted=True))
        await room.leave(a)  # a pending announcement dies with its participant
        await asyncio.sleep(MUTE_ANNOUNCE_INTERVAL_S + 0.1)
        assert [e["muted"] for e in of(sent, "participant.updated")] == [True, False]
    finally:
        await room.leave(b)


async def test_a_joiner_while_a_mute_change_waits_ends_with_the_true_state() -> None:
    """A joiner's room.state showed the live mute while the others knew the announced one:
    muted (told), unmuted (waiting), a joiner (shown unmuted), muted again: the waiting
    announcement found nothing new to tell, and the joiner showed the speaker unmuted for
    good. room.state now shows what the room was told; the change follows."""
    room = Room("r", ToneEngine(), Config())
    toggler = room.join("a", speaking=False, host=True, expects_channel=False)
    toggler.handle_message(msg(type="mute", muted=True))  # told at once
    toggler.handle_message(msg(type="mute", muted=False))  # waits for the interval
    joiner = room.join("b", speaking=False, host=True, expects_channel=False)
    seen: list[Event] = [{"type": "room.state", **room.describe(joiner)}]
    joiner.outbox.send = seen.append  # type: ignore[method-assign]
    toggler.handle_message(msg(type="mute", muted=True))
    try:
        await asyncio.sleep(MUTE_ANNOUNCE_INTERVAL_S + 0.1)
        view = None
        for event in seen:  # what the joiner's page believes
            if event["type"] == "room.state":
                view = next(
                    p["muted"]
                    for p in event["participants"]
                    if p["participant_id"] == toggler.participant_id
                )
            elif event["type"] == "participant.updated":
                view = event["muted"]
        assert view is True, seen
    finally:
        await room.leave(joiner)
        await room.leave(toggler)


async def test_a_room_participants_stream_left_open_is_ended_for_everyone_else() -> None:
    """A participant's stream left open held the room's agent for everyone: every other
    participant's chat waited for it for good. It is ended after its idle timeout (what it
    sent is spoken), its writer told, and the chat is answered."""
    settings = SpeechSettings(stream_idle_timeout_s=0.5)
    room = Room("r", ToneEngine(seconds_per_word=0.02), Config(speech=settings))
    room.start()
    (a, sent_a), (b, sent_b) = members(room, "sa", "sb")
    try:
        a.handle_message(msg(type="text.delta", id="a1", delta="Hello everyone, "))
        b.handle_message(msg(type="chat", text="What is two plus two?"))
        await wait_for(lambda: len(of(sent_b, "speech.ended")) == 2, timeout=10)
        assert spoken(sent_b) == ["Hello everyone,", "What is two plus two?"]  # echo brain
        assert [(e["code"], e["id"]) for e in of(sent_a, "error")] == [("stream_timeout", "a1")]
        assert not of(sent_b, "error")
    finally:
        await room.close()


# --- a stream whose speech the engine failed ---------------------------------------------------
async def test_a_streams_deltas_after_its_speech_failed_are_refused_not_swallowed() -> None:
    """Bug: an engine failure ended a text stream's utterance (tts_failed, speech.ended
    interrupted) but left the stream open: its later deltas were accepted (no error) into
    a queue nobody read again, never spoken, and the dead stream kept other writers out
    (stream_open) until its text.end. They are refused now, and another writer may speak."""
    events: list[Event] = []
    engine = FailingEngine(seconds_per_word=0.05)
    p = pipeline(events, engine)
    drain = Drain(p)
    engine.mode = "start"  # the first sentence fails (a worker crash, a GPU out of memory)
    assert p.text_delta("First sentence here! ", "s") == "s"
    await wait_for(lambda: bool(of(events, "speech.ended")))
    assert [e.get("code", e["type"]) for e in events] == [
        "speech.started",
        "tts_failed",
        "speech.ended",
    ]
    engine.mode = "ok"
    with pytest.raises(SpeechError) as refused:
        p.text_delta("Second sentence here! ", "s")
    assert refused.value.code == "stream_refused"
    assert "speech engine failed" in refused.value.message  # its tts_failed comes later
    p.text_delta("Someone else. ", "other", owner="participant")  # the stream is free
    p.text_end(owner="participant")
    assert p.text_end() is None  # the writer's text.end forgets the refused stream
    p.text_delta("A new stream. ", "s2")
    p.text_end()
    await wait_for(lambda: len(of(events, "speech.ended")) == 3)
    assert spoken(events) == ["Someone else.", "A new stream."]
    balanced(events)
    drain.stop()
    await p.close()


async def test_a_reply_whose_speech_failed_stops_asking_the_llm_with_one_error() -> None:
    """The same for a brain's reply: the rest of the answer is not read from the LLM (it
    would be refused), and the client hears of the failure once, tts_failed, with the
    reply's id, not a second stream_refused."""
    engine = FailingEngine(seconds_per_word=0.05)
    session = AgentSession("s", engine, Config())
    events: list[Event] = []
    session.outbox.send = events.append  # type: ignore[method-assign]
    brain = SlowBrain(["One two three. ", "Four five six. ", "Seven. ", "Eight."], delay=0.2)
    read: list[str] = []

    async def reply(history: list[Message]) -> AsyncIterator[str]:
        async for delta in SlowBrain.reply(brain, history):
            read.append(delta)
            yield delta

    brain.reply = reply  # type: ignore[method-assign]
    session.conversation._brain = brain
    session.pipeline.start()
    drain = Drain(session.pipeline)
    engine.mode = "start"
    session.handle_message(msg(type="chat", text="count for me"))
    await wait_for(lambda: bool(of(events, "speech.ended")), timeout=10)
    await asyncio.sleep(0.6)  # the LLM's later deltas would have come by now
    errors = [(e["code"], e["id"]) for e in of(events, "error")]
    reply_id = of(events, "speech.ended")[0]["id"]
    assert errors == [("tts_failed", reply_id)], events
    assert len(read) < 4, read  # it stopped reading the answer
    drain.stop()
    await session.close()


async def test_a_stream_with_nothing_to_speak_is_refused_as_a_say_of_it_is() -> None:
    """A stream of only emoji or dashes got speech.started and speech.ended: something
    seemed to be spoken where nothing was. Its text.end is refused with empty_text (the
    stream's id), as a say of the same text is, and no speech event of it goes out."""
    events: list[Event] = []
    p = pipeline(events)
    drain = Drain(p)
    p.text_delta("... \U0001f600 ", "quiet")
    p.text_delta("---", "quiet")
    with pytest.raises(SpeechError) as refused:
        p.text_end()
    assert (refused.value.code, refused.value.request_id) == ("empty_text", "quiet")
    p.text_delta("Real words.", "words")
    p.text_end()
    await wait_for(lambda: bool(of(events, "speech.ended")))
    await asyncio.sleep(0.1)
    assert [e for e in events if e["id"] == "quiet"] == []
    assert spoken(events) == ["Real words."]
    drain.stop()
    await p.close()


async def test_an_empty_stream_in_a_room_is_refused_to_its_writer_alone() -> None:
    """In a room the agent's speech events go to everyone: one member's empty stream must
    not show an error (or anything) on every other page (found by review)."""
    room = Room("r", ToneEngine(seconds_per_word=0.02), Config())
    room.start()
    (a, sent_a), (_, sent_b) = members(room, "sa", "sb")
    try:
        a.handle_message(msg(type="text.delta", id="e1", delta="\U0001f600 ---"))
        a.handle_message(msg(type="text.end"))
        a.handle_message(msg(type="say", id="s1", text="Then words."))
        await wait_for(lambda: bool(of(sent_b, "speech.ended")), timeout=10)
        assert [(e["code"], e["id"]) for e in of(sent_a, "error")] == [("empty_text", "e1")]
        assert [e for e in sent_b if e.get("id") == "e1"] == []
        assert not of(sent_b, "error")
        assert [e["id"] for e in of(sent_b, "speech.started")] == ["s1"]
    finally:
        await room.close()


async def test_a_leavers_refused_stream_ids_are_forgotten() -> None:
    """A participant who had its own stream open and a second one refused (stream_open)
    left that refused id in the room's pipeline for the room's whole life on leaving:
    one entry per such participant, as ids are never reused."""
    room = Room("r", ToneEngine(seconds_per_word=0.02), Config())
    a = room.join("sa", speaking=False, host=True, expects_channel=False)
    b = room.join("sb", speaking=False, host=True, expects_channel=False)
    sent: list[Event] = []
    a.outbox.send = sent.append  # type: ignore[method-assign]
    try:
        a.handle_message(msg(type="text.delta", id="one", delta="First stream. "))
        a.handle_message(msg(type="text.delta", id="two", delta="Second stream. "))
        assert [e["code"] for e in of(sent, "error")] == ["stream_open"]
        assert not room.pipeline.opens_stream("two", owner=a.participant_id)  # refused
        await room.leave(a)
        assert room.pipeline.opens_stream("two", owner=a.participant_id)  # forgotten
    finally:
        await room.leave(b)
        await room.close()
