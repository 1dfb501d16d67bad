"""The data-channel contract under a demanding client: errors that name the request, a
refused stream dropped whole, events sent when heard, the idle timeout."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import pytest

from agent.config import Config, LifecycleSettings, SpeechSettings
from agent.engine import PCM, EngineError, VoiceOptions
from agent.session import AgentSession
from agent.speech import SpeechError, SpeechPipeline
from tests.conftest import LiveServer
from tests.doubles import ToneEngine
from tests.rtc_client import RtcClient
from tests.test_speech_pipeline import Drain, wait_for

Event = dict[str, Any]


def msg(**fields: Any) -> str:
    return json.dumps(fields)


class FailsOnBoom(ToneEngine):
    """Speaks tones, but raises at once (no audio) for text containing "boom"."""

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        if "boom" in text:
            raise EngineError("the engine's worker crashed")
        async for chunk in super().synthesize(text, voice, continuation=continuation):
            yield chunk


async def test_an_utterances_engine_error_is_not_sent_before_it_is_heard() -> None:
    """Server events are sent when the listener hears them (README). An utterance B that
    failed at once behind a playing A had its ``tts_failed`` sent while A was still
    buffered: before A's end and B's start, naming an id the client had not seen yet."""
    events: list[Event] = []
    pipeline = SpeechPipeline(FailsOnBoom(), SpeechSettings(), events.append)
    pipeline.start()
    pipeline.say("one two three four five six", "A")  # 1.5 s, buffered (nothing plays yet)
    pipeline.say("boom", "B")
    await asyncio.sleep(0.2)
    drain = Drain(pipeline)  # now the listener hears it
    await wait_for(lambda: {"type": "speech.ended", "id": "B", "interrupted": True} in events)
    drain.stop()
    await pipeline.close()
    order = [(e["type"], e["id"]) for e in events if e["type"] != "speech.segment"]
    assert order == [
        ("speech.started", "A"),
        ("speech.ended", "A"),
        ("speech.started", "B"),
        ("error", "B"),
        ("speech.ended", "B"),
    ], order


async def test_a_refused_chat_or_say_error_carries_the_id_the_client_sent() -> None:
    """An ``error``'s ``id`` is the request's (README). A chat/say/delta whose text was
    missing or not a string was refused with ``bad_message`` and no id, although the id
    it carried was valid: the client could not tell which request failed."""
    session = AgentSession("s", ToneEngine(seconds_per_word=0.05), Config())
    events: list[Event] = []
    session.outbox.send = events.append  # type: ignore[method-assign]
    session.handle_message(msg(type="chat", id="q1"))
    session.handle_message(msg(type="say", text=None, id="s1"))
    session.handle_message(msg(type="text.delta", delta=7, id="d1"))
    session.pipeline.discard()
    session.conversation.discard()
    assert [(e["code"], e.get("id")) for e in events] == [
        ("bad_message", "q1"),
        ("bad_message", "s1"),
        ("bad_message", "d1"),
    ]


# --- through the real server -------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", port=0, lifecycle=LifecycleSettings(idle_timeout_s=1.5))],
)
async def test_a_stream_left_open_does_not_defeat_the_idle_timeout(
    live_server: LiveServer,
) -> None:
    """A session with no client message and no speech for --idle-timeout is closed
    (README). A client that opened a text stream (its LLM call died, no text.end) and went
    quiet kept its session, and a --max-sessions place, for good: an open stream counted
    as speech. Now only audio being made or played does."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            client.send({"type": "text.delta", "delta": "One two! ", "id": "s"})
            await client.wait_event(lambda e: e["type"] == "speech.segment")
            started = time.monotonic()
            event = await client.wait_event(lambda e: e["type"] == "session.closed", 6)
            assert event == {"type": "session.closed", "reason": "idle_timeout"}
        finally:
            await client.close()
    assert time.monotonic() - started <= 4.0


async def test_waiting_for_a_clients_next_delta_is_not_counted_as_underruns() -> None:
    """voice_agent_underruns_total counts ticks with no speech ready while an utterance is
    being generated (README, Metrics). A stream whose client had not finished its first
    sentence has nothing to generate, yet each silent tick was counted: 50 a second."""
    events: list[Event] = []
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(), events.append)
    pipeline.start()
    pipeline.text_delta("The client is still typing its first sentence", "s")
    await asyncio.sleep(0.05)  # the worker takes the stream and waits for a sentence
    for _ in range(50):  # one second of track ticks
        assert pipeline.buffer.pop() is None
    underruns = pipeline.buffer.underruns
    await pipeline.close()
    assert underruns == 0


async def test_the_rest_of_a_refused_stream_is_not_spoken_from_mid_sentence() -> None:
    """A stream whose opening delta was refused (rate_limited here; queue_full and
    stream_open alike) was not remembered: its next delta opened the stream instead, and
    "Do not press the red button!" was spoken as "press the red button!". The rest of a
    refused stream is now dropped up to its text.end, as an interrupted one's is."""
    calls = 0

    def admit() -> float:
        nonlocal calls
        calls += 1
        return 5.0 if calls == 1 else 0.0  # the first speech request is over the limit

    from agent.hooks import SessionHooks

    session = AgentSession(
        "s", ToneEngine(seconds_per_word=0.01), Config(), hooks=SessionHooks(admit_speech=admit)
    )
    events: list[Event] = []
    session.outbox.send = events.append  # type: ignore[method-assign]
    session.pipeline.start()
    drain = Drain(session.pipeline)
    session.handle_message(msg(type="text.delta", delta="Do not ", id="x"))
    session.handle_message(msg(type="text.delta", delta="press the red button! ", id="x"))
    session.handle_message(msg(type="text.end"))  # accepted: it ends the refused stream
    # Sent again from its start, as the error says: spoken whole.
    session.handle_message(msg(type="text.delta", delta="Do not ", id="x"))
    session.handle_message(msg(type="text.delta", delta="press the red button!", id="x"))
    session.handle_message(msg(type="text.end"))
    await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
    drain.stop()
    await session.close()
    errors = [(e["code"], e.get("id")) for e in events if e["type"] == "error"]
    assert errors == [("rate_limited", "x"), ("stream_refused", "x")], errors
    spoken = [e["text"] for e in events if e["type"] == "speech.segment"]
    assert spoken == ["Do not press the red button!"], spoken


async def test_a_stream_refused_while_anothers_was_open_stays_refused_until_its_end() -> None:
    """Refused stream_open (a room participant's, the brain's reply's stream was open), a
    client's next delta opened its stream from mid-sentence once that stream ended. A
    malformed delta refuses its stream alike."""
    for first in ({"delta": "Do not "}, {"delta": ["not", "a", "string"]}):
        session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config())
        events: list[Event] = []
        session.outbox.send = events.append  # type: ignore[method-assign]
        session.pipeline.start()
        session.pipeline.text_delta("Someone else's. ", owner="reply-1")  # open meanwhile
        session.handle_message(msg(type="text.delta", **first))
        session.pipeline.text_end(owner="reply-1")
        session.handle_message(msg(type="text.delta", delta="press the red button! "))
        assert not session.pipeline.opens_stream(None)
        session.handle_message(msg(type="text.end"))
        assert session.pipeline.opens_stream(None)
        with pytest.raises(SpeechError, match=r"without a text\.delta"):  # ended: no_stream now
            session.pipeline.text_end()
        await session.close()
        codes = [e["code"] for e in events if e["type"] == "error"]
        expected = "stream_open" if isinstance(first["delta"], str) else "bad_message"
        assert codes == [expected, "stream_refused"], (first, codes)


@pytest.mark.parametrize("refusal", ["text_too_long", "too_large"])
async def test_a_refused_middle_delta_speaks_what_came_before_and_drops_the_rest(
    refusal: str,
) -> None:
    """A delta refused mid-stream left the stream open, and a shorter delta after it was
    taken: the words spoken had a hole in the middle. Past the text limit
    (``text_too_long``); and over the message limit (``too_large``), refused before its type
    was read. Now the stream ends at the refusal: what came before is spoken, the rest
    dropped up to its text.end, the error names the stream; the next one is spoken whole."""
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config())
    events: list[Event] = []
    session.outbox.send = events.append  # type: ignore[method-assign]
    session.pipeline.start()
    drain = Drain(session.pipeline)
    oversize = (
        "y" * session.pipeline.settings.max_text_chars
        if refusal == "text_too_long"
        else "y " * session.config.speech.max_message_bytes
    )
    try:
        session.handle_message(msg(type="text.delta", delta="First part. ", id="x"))
        session.handle_message(msg(type="text.delta", delta=oversize, id="x"))
        session.handle_message(msg(type="text.delta", delta="Missing middle. "))
        session.handle_message(msg(type="text.end"))
        session.handle_message(msg(type="text.delta", delta="Next stream.", id="z"))
        session.handle_message(msg(type="text.end"))
        await wait_for(lambda: {"type": "speech.ended", "id": "z", "interrupted": False} in events)
    finally:
        drain.stop()
        await session.close()
    errors = [(e["code"], e.get("id")) for e in events if e["type"] == "error"]
    assert errors == [(refusal, "x"), ("stream_refused", None)], errors
    spoken = [(e["id"], e["text"]) for e in events if e["type"] == "speech.segment"]
    assert spoken == [("x", "First part."), ("z", "Next stream.")], spoken


async def _failed_behind_unheard_speech(events: list[Event]) -> SpeechPipeline:
    """A pipeline whose utterance B failed (no audio) behind A, buffered and unheard."""
    pipeline = SpeechPipeline(FailsOnBoom(), SpeechSettings(), events.append)
    pipeline.start()
    pipeline.say("one two three four five six seven eight", "A")
    pipeline.say("boom", "B")
    await wait_for(lambda: pipeline.stats.engine_errors == 1)
    return pipeline


async def test_an_engine_error_cut_by_an_interrupt_still_reaches_the_client() -> None:
    """Held for the utterance's end, a failure is sent with it also when an interrupt
    ends it first: the engine's trouble is not lost."""
    events: list[Event] = []
    pipeline = await _failed_behind_unheard_speech(events)
    pipeline.interrupt()
    await pipeline.close()
    order = [(e["type"], e["id"]) for e in events]
    assert order == [
        ("speech.ended", "A"),
        ("error", "B"),
        ("speech.ended", "B"),
    ], order
    assert events[1]["code"] == "tts_failed"


async def test_an_engine_error_held_for_its_end_is_sent_when_the_session_closes_first() -> None:
    events: list[Event] = []
    pipeline = await _failed_behind_unheard_speech(events)
    await pipeline.close()
    assert [(e["type"], e.get("code"), e["id"]) for e in events] == [("error", "tts_failed", "B")]


async def test_a_second_stream_refused_while_the_writers_own_is_open_stays_refused() -> None:
    """A delta with a new id while the client's own stream was open was refused
    (stream_open), and after that stream's end its next delta opened it mid-sentence."""
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config())
    events: list[Event] = []
    session.outbox.send = events.append  # type: ignore[method-assign]
    session.pipeline.start()
    drain = Drain(session.pipeline)
    session.handle_message(msg(type="text.delta", delta="First one ", id="x"))
    session.handle_message(msg(type="text.delta", delta="Do not ", id="y"))  # refused
    session.handle_message(msg(type="text.delta", delta="goes on."))  # x's, id-less
    session.handle_message(msg(type="text.end"))  # x's end
    session.handle_message(msg(type="text.delta", delta="press the red button! ", id="y"))
    session.handle_message(msg(type="text.end"))  # y's end
    session.handle_message(msg(type="text.delta", delta="Fresh start.", id="y"))
    session.handle_message(msg(type="text.end"))
    await wait_for(lambda: len([e for e in events if e["type"] == "speech.ended"]) == 2)
    drain.stop()
    await session.close()
    errors = [(e["code"], e.get("id")) for e in events if e["type"] == "error"]
    assert errors == [("stream_open", "y"), ("stream_refused", "y")], errors
    spoken = [(e["id"], e["text"]) for e in events if e["type"] == "speech.segment"]
    assert spoken == [("x", "First one goes on."), ("y", "Fresh start.")], spoken


async def test_a_stream_left_open_is_ended_after_its_idle_timeout() -> None:
    """A stream whose writer went quiet (its LLM call died, no text.end) held every later
    say and reply of the session for good (a room's, for everyone in it). After
    stream_idle_timeout_s it is ended as its text.end would: what it sent is spoken, the
    writer is told (stream_timeout), and its later deltas are refused up to its end."""
    settings = SpeechSettings(stream_idle_timeout_s=0.3)
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config(speech=settings))
    events: list[Event] = []
    session.outbox.send = events.append  # type: ignore[method-assign]
    session.start()  # its once-a-second tick ends the stalled stream
    drain = Drain(session.pipeline)
    try:
        session.handle_message(msg(type="text.delta", delta="Hello there. And then", id="x"))
        session.handle_message(msg(type="say", text="Queued behind it.", id="q"))
        await wait_for(lambda: any(e.get("code") == "stream_timeout" for e in events), 3)
        await wait_for(lambda: {"type": "speech.ended", "id": "q", "interrupted": False} in events)
        session.handle_message(msg(type="text.delta", delta="more of x"))  # refused
        session.handle_message(msg(type="text.end"))  # accepted: x's end
    finally:
        drain.stop()
        await session.close()
    spoken = [(e["id"], e["text"]) for e in events if e["type"] == "speech.segment"]
    assert spoken == [("x", "Hello there."), ("x", "And then"), ("q", "Queued behind it.")]
    errors = [(e["code"], e.get("id")) for e in events if e["type"] == "error"]
    assert errors == [("stream_timeout", "x"), ("stream_refused", None)], errors


async def test_only_a_listed_writers_stream_that_went_quiet_is_ended() -> None:
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(stream_idle_timeout_s=30), print)
    pipeline.text_delta("A reply being written", owner="reply-1")
    now = time.monotonic()
    assert pipeline.end_stalled_stream(now + 60, ("client",)) is None  # not the client's
    assert pipeline.end_stalled_stream(now + 10, ("reply-1",)) is None  # not quiet for long
    ended = pipeline.end_stalled_stream(now + 60, ("reply-1",))
    assert ended is not None and ended[0] == "reply-1"
    assert pipeline.opens_stream("another", owner="reply-1")
    pipeline.discard()


async def test_a_stream_ended_for_stalling_keeps_a_second_refused_stream_refused() -> None:
    """One marker per writer: a second refused stream's was overwritten when the open
    one was ended (idle timeout, text_too_long), and its rest then opened mid-sentence."""
    p = SpeechPipeline(ToneEngine(), SpeechSettings(stream_idle_timeout_s=30), print)
    p.text_delta("First one ", "s")
    with pytest.raises(SpeechError, match="still open"):
        p.text_delta("Do not ", "t")  # stream_open
    p.refuse_rest("t")  # as the session does: t refused up to its end
    with pytest.raises(SpeechError) as exc:
        p.text_delta("press ", "t")
    assert exc.value.code == "stream_refused"
    # s goes quiet and is ended by the idle timeout
    assert p.end_stalled_stream(time.monotonic() + 60, ("client",)) == ("client", "s")
    # t's rest must still be refused (it was never ended) ...
    assert not p.opens_stream("t"), "t's rest would open a stream mid-sentence"
    p.discard()


async def test_a_refused_open_stream_keeps_a_second_refused_stream_refused() -> None:
    p = SpeechPipeline(ToneEngine(), SpeechSettings(max_text_chars=20), print)
    p.text_delta("First one ", "s")
    with pytest.raises(SpeechError, match="still open"):
        p.text_delta("Do not ", "t")
    p.refuse_rest("t")
    with pytest.raises(SpeechError) as exc:
        p.text_delta("x" * 30, "s")  # text_too_long on s
    assert exc.value.code == "text_too_long"
    p.refuse_rest("s")
    assert not p.opens_stream("t"), "t's rest would open a stream mid-sentence"
    p.discard()


async def test_an_id_less_delta_of_a_refused_stream_keeps_its_id_refused() -> None:
    """A stream 'x' refused (stream_open: a reply was streaming); the client went on with
    id-less deltas (each stream_refused, which re-marked the stream id-less), then one
    with its id again: opened mid-sentence."""

    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config())
    events: list[Event] = []
    session.outbox.send = events.append  # type: ignore[method-assign]
    session.pipeline.start()
    session.pipeline.text_delta("Someone else's. ", owner="reply-1")
    session.handle_message(msg(type="text.delta", delta="Do not ", id="x"))  # stream_open
    session.handle_message(msg(type="text.delta", delta="ever "))  # stream_refused
    session.pipeline.text_end(owner="reply-1")
    opens = session.pipeline.opens_stream("x")
    session.handle_message(msg(type="text.delta", delta="press the red button!", id="x"))
    codes = [e["code"] for e in events if e["type"] == "error"]
    await session.close()
    assert not opens and codes == ["stream_open", "stream_refused", "stream_refused"], (
        opens,
        codes,
    )
