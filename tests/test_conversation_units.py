"""Units of the conversation: the speech detector, settings from flags/env, the wire, clients."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from agent.brain import EchoBrain, alternating
from agent.config import Config
from agent.conversation_config import ListenSettings, ServiceSettings
from agent.httpservice import ServiceError
from agent.llm import ChatCompletions, Message
from agent.protocol import ConfigUpdate, ProtocolError, parse_message
from agent.session import AgentSession
from agent.speech import SpeechPipeline
from agent.stt import Transcriber, wav_bytes
from agent.turns import Conversation, Reply
from agent.vad import Activity, ActivityEvent, SpeechDetector
from signaling.cli import build_parser, config_from_args
from tests.doubles import FailingEngine, ToneEngine, ToneMicrophone
from tests.services import FakeLLM, FakeSTT
from tests.test_speech_pipeline import Drain, wait_for


def run(detector: SpeechDetector, probabilities: list[float]) -> list[tuple[str, int, int]]:
    """(event, at window, names window) for each event."""
    out = []
    for p in probabilities:
        event = detector.push(p)
        if event is not None:
            out.append((event.kind.value, detector.index, event.window))
    return out


def test_onset_needs_the_minimum_speech_duration() -> None:
    detector = SpeechDetector(ListenSettings(min_speech_ms=64, end_of_turn_silence_ms=96))
    assert detector.onset_windows == 2 and detector.silence_windows == 3
    # A single loud window (a click) is ignored; two in a row start the turn at the first.
    events = run(detector, [0.1, 0.9, 0.1, 0.9, 0.95, 0.9, 0.1, 0.1, 0.1, 0.1])
    assert events == [("started", 4, 3), ("ended", 8, 5)]


def test_hysteresis_and_max_turn() -> None:
    settings = ListenSettings(min_speech_ms=0, end_of_turn_silence_ms=64, max_turn_s=0.32)
    detector = SpeechDetector(settings)
    # Between the thresholds (0.35..0.5) neither starts speech nor counts as silence.
    assert run(detector, [0.4, 0.45, 0.4]) == []
    events = run(detector, [0.6, 0.4, 0.4, 0.2, 0.4, 0.2, 0.2])
    assert events == [("started", 3, 3), ("ended", 8, 3)]  # 0.4 neither resets nor counts
    # A turn that never pauses is cut at max_turn_s (10 windows).
    assert run(detector, [0.9] * 12)[:2] == [("started", 10, 10), ("ended", 19, 19)]


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        ListenSettings(vad_threshold=0.3, vad_neg_threshold=0.5)
    with pytest.raises(ValueError):
        ListenSettings(end_of_turn_silence_ms=10)
    with pytest.raises(ValueError):
        ServiceSettings(llm_timeout_s=0)
    assert "secret" not in repr(ServiceSettings(llm_api_key="secret", stt_api_key="secret"))


def test_flags_and_environment() -> None:
    env = {
        "VOICE_AGENT_LLM_URL": "http://llm:8000/v1",
        "VOICE_AGENT_LLM_API_KEY": "k-env",
        "VOICE_AGENT_MIN_SPEECH_MS": "96",
        "VOICE_AGENT_NO_BARGE_IN": "1",
    }
    argv = ["serve", "--stt-url", "http://stt/v1", "--end-of-turn-ms", "800", "--llm-model", "m"]
    config = config_from_args(build_parser(env).parse_args(argv), env)
    assert config.services.llm_base_url == "http://llm:8000/v1"
    assert config.services.llm_api_key == "k-env" and config.services.llm_model == "m"
    assert config.services.stt_base_url == "http://stt/v1"
    assert config.listen.min_speech_ms == 96 and config.listen.end_of_turn_silence_ms == 800
    assert config.listen.barge_in is False and config.listen.enabled is True
    defaults = config_from_args(build_parser({}).parse_args(["serve"]), {})
    assert defaults.services.llm_base_url is None and defaults.services.stt_base_url is None
    assert defaults.listen == ListenSettings()


def test_config_message_turns_barge_in_on_and_off() -> None:
    message = parse_message('{"type": "config", "barge_in": false}', 1000)
    assert message == ConfigUpdate({"barge_in": False})
    with pytest.raises(ProtocolError) as info:
        parse_message('{"type": "config", "barge_in": "no"}', 1000)
    assert info.value.code == "bad_config"


async def test_llm_stream_yields_tokens_and_reports_errors() -> None:
    async with FakeLLM() as llm, aiohttp.ClientSession() as http:
        assert isinstance(llm, FakeLLM)
        llm.replies.append(["a", "b", "c"])
        client = ChatCompletions(ServiceSettings(llm_base_url=llm.url, llm_timeout_s=0.5), http)
        tokens = [t async for t in client.stream([{"role": "user", "content": "x"}])]
        assert tokens == ["a", "b", "c"]
        llm.status = 429
        with pytest.raises(ServiceError) as info:
            [t async for t in client.stream([])]
        assert info.value.code == "llm_failed" and "429" in info.value.message
        llm.status = 200
        llm.replies.append(["slow", "er"])
        llm.token_delay_s = 0.8  # past the 0.5 s timeout (the fake server waits it out)
        with pytest.raises(ServiceError) as info:
            [t async for t in client.stream([])]
        assert info.value.code == "llm_timeout"
    unreachable = ServiceSettings(llm_base_url=llm.url)  # the server is gone now
    async with aiohttp.ClientSession() as http:
        with pytest.raises(ServiceError) as info:
            [t async for t in ChatCompletions(unreachable, http).stream([])]
        assert info.value.code == "llm_failed"


async def test_time_the_consumer_holds_the_llm_stream_is_not_the_servers() -> None:
    """Bug: the wait for the next event counted from the last one received, so the time the
    consumer spent before asking for the next delta (a reply waiting behind the client's
    own text stream) was blamed on the server: past --llm-timeout the read was cancelled
    before it ran (3.11's wait_for(read, 0)), with the rest of the answer already there.
    Once the consumer is back, the server is held to the timeout again."""
    async with FakeLLM() as llm, aiohttp.ClientSession() as http:
        assert isinstance(llm, FakeLLM)
        llm.replies.append(["One. ", "Two. ", "Three."])
        client = ChatCompletions(ServiceSettings(llm_base_url=llm.url, llm_timeout_s=0.2), http)
        got = []
        async for delta in client.stream([{"role": "user", "content": "x"}]):
            got.append(delta)
            if len(got) == 1:
                await asyncio.sleep(0.3)  # meanwhile the server sends the rest
        assert got == ["One. ", "Two. ", "Three."]
        llm.replies.append(["a", "b"])
        llm.token_delay_s = 0.6  # "b" comes 0.3 s after the consumer is back: too late
        got = []
        with pytest.raises(ServiceError) as info:
            async for delta in client.stream([]):
                got.append(delta)
                await asyncio.sleep(0.3)
        assert got == ["a"] and info.value.code == "llm_timeout"


async def test_transcriber_uploads_a_wav_and_reads_the_text() -> None:
    async with FakeSTT() as stt, aiohttp.ClientSession() as http:
        assert isinstance(stt, FakeSTT)
        stt.transcripts.append("  hello world ")
        settings = ServiceSettings(stt_base_url=stt.url, stt_language="en", stt_timeout_s=0.5)
        client = Transcriber(settings, http)
        audio = np.zeros(16_000, dtype=np.float32)
        assert await client.transcribe(audio) == "hello world"
        upload = stt.uploads[0]
        assert upload.wav == wav_bytes(audio) and upload.duration_s() == 1.0
        assert upload.fields == {"model": "whisper-1", "response_format": "json", "language": "en"}
        assert upload.authorization is None
        stt.stall_s = 0.8  # past the 0.5 s timeout (the fake server waits it out)
        with pytest.raises(ServiceError) as info:
            await client.transcribe(audio)
        assert info.value.code == "stt_timeout"


def test_detector_kinds_are_the_wire_names() -> None:
    assert {a.value for a in Activity} == {"started", "ended"}


async def test_a_resumed_connection_s_microphone_is_listened_to() -> None:
    """A resume replaces the connection (stop_listening): the new connection's track must
    take the old one's place, not be merely drained, whether or not the old track ended (one
    whose connection never came up never does), and nothing keeps reading the old tracks."""
    from types import SimpleNamespace

    from agent.config import Config
    from agent.session import AgentSession
    from agent.vad import VadPool

    session = AgentSession("s", ToneEngine(), Config())
    pool = VadPool(1)
    receiver = SimpleNamespace()  # not aiortc's: the jitter buffer is left alone
    first, second = ToneMicrophone(440), ToneMicrophone(880)
    try:
        session.listen(first, receiver, pool)  # type: ignore[arg-type]
        assert session.inbound is not None and session.inbound.track is first
        session.listen(second, receiver, pool)  # type: ignore[arg-type]
        old = session.inbound
        assert old.track is first  # a second live track is only drained
        readers = [*old._tasks, *session._drain_tasks]  # reader, scorer, quiet watch; drain
        await session.stop_listening()  # a resume: the old peer connection closed
        # Both tracks still live (as a never-connected receiver's stays): nothing reads them.
        assert first.readyState == second.readyState == "live"
        assert len(readers) == 4 and all(task.done() for task in readers)
        assert session.inbound is None and not session._drain_tasks
        third = ToneMicrophone(660)
        session.listen(third, receiver, pool)  # type: ignore[arg-type]
        assert session.inbound is not None and session.inbound.track is third
    finally:
        await session.close()
        pool.executor.shutdown(wait=False)


@pytest.mark.parametrize("listening", [True, False])
async def test_the_voice_activity_model_loads_at_startup_not_at_the_first_microphone(
    listening: bool,
) -> None:
    # Loading it imports torch: left to the first session's microphone, that stalled every
    # session's audio by up to 0.6 s (tests/test_fuzz.py's well-formed session saw it).
    # /readyz says ready once it is loaded; offers are answered meanwhile.
    import asyncio

    from agent.config import Config
    from signaling.keys import SESSIONS
    from tests.conftest import serve
    from tests.doubles import ToneEngine

    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=listening))
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        pool = server.app[SESSIONS].vad_pool
        statuses = []
        async with asyncio.timeout(30):
            while not statuses or statuses[-1] != 200:
                async with http.get(server.url + "/readyz") as resp:
                    statuses.append(resp.status)
                    body = await resp.json()
                if resp.status != 200:
                    assert body["error"]["code"] == "not_ready", body
                    await asyncio.sleep(0.02)
        assert len(server.app[SESSIONS]) == 0  # no session, no microphone
        # Listening: loaded by the time it is ready. Not listening: torch is not even loaded.
        assert (pool._base is not None) is listening


# --- turns: what the user said, in order, and answered ----------------------------------------
class ScriptedSTT:
    """Speech-to-text whose n-th call answers the n-th (text, delay) of its script; a
    ServiceError in place of the text is raised instead."""

    def __init__(self, *script: tuple[str | ServiceError, float]) -> None:
        self.script = list(script)
        self.calls = 0

    async def transcribe(self, audio: np.ndarray) -> str:
        text, delay = self.script[self.calls]
        self.calls += 1
        await asyncio.sleep(delay)
        if isinstance(text, ServiceError):
            raise text
        return text


class RecordingBrain:
    """Answers "Sure." after ``think_s``; records the history each reply was asked with."""

    name = "recording"

    def __init__(self, think_s: float = 0.0) -> None:
        self.think_s = think_s
        self.asked: list[list[Message]] = []

    async def reply(self, history: list[Message]) -> AsyncIterator[str]:
        self.asked.append([dict(m) for m in history])
        await asyncio.sleep(self.think_s)
        yield "Sure."


def talking_session(
    stt: ScriptedSTT, brain: RecordingBrain, engine: ToneEngine | None = None
) -> tuple[AgentSession, list[dict[str, Any]], Drain]:
    session = AgentSession("s", engine or ToneEngine(seconds_per_word=0.05), Config())
    events: list[dict[str, Any]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    session.conversation._transcriber = stt  # type: ignore[assignment]
    session.conversation._brain = brain
    session.pipeline.start()
    return session, events, Drain(session.pipeline)


def say_turn(session: AgentSession, seconds: float = 1.0) -> None:
    """The detector's onset and end of turn, ``seconds`` of (silent) audio between."""
    conversation = session.conversation
    conversation.user_started(ActivityEvent(Activity.STARTED, 0))
    conversation.user_ended(
        np.zeros(int(16_000 * seconds), np.float32), ActivityEvent(Activity.ENDED, 0)
    )


@pytest.mark.parametrize(
    ("preparing", "cough"),
    [
        ("thinking", ""),
        ("before_audio", ""),
        ("thinking", ServiceError("stt_failed", "the STT is down")),
    ],
    ids=["cough-while-thinking", "cough-before-audio", "failed-stt-while-thinking"],
)
async def test_a_cough_that_cancels_an_unheard_reply_does_not_lose_the_question(
    preparing: str, cough: str | ServiceError
) -> None:
    """Bug: a barge-in that cancelled a reply before any of it was heard left the question
    marked answered, so a cough after it (an empty transcript, or a failed one) got no
    reply: "What time is it?" was never answered."""
    brain = RecordingBrain(think_s=0.5 if preparing == "thinking" else 0.0)
    engine = ToneEngine(seconds_per_word=0.05, first_chunk_delay_s=0.5)
    stt = ScriptedSTT(("What time is it?", 0.0), (cough, 0.05))
    session, events, drain = talking_session(stt, brain, engine)
    try:
        say_turn(session)
        await wait_for(lambda: brain.asked)
        if preparing == "before_audio":
            await wait_for(lambda: session.pipeline.busy)  # the reply's stream is open
        assert not [e for e in events if e["type"] == "speech.segment"]  # nothing heard yet
        say_turn(session, 0.2)  # a cough: barges in, cancels the reply
        await wait_for(lambda: len(brain.asked) == 2, timeout=3)
        assert brain.asked[1] == [{"role": "user", "content": "What time is it?"}]
        await wait_for(lambda: session.conversation.history[-1]["content"], timeout=3)
        assert session.conversation.history == [
            {"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": "Sure."},
        ]
    finally:
        drain.stop()
        await session.close()


async def test_the_clients_interrupt_withdraws_the_question_a_cough_does_not_revive_it() -> None:
    """The client's `interrupt` (a Stop button) cancels the reply unheard; unlike a barge-in's
    cut, the question goes with it: a cough after that gets no answer to it."""
    brain = RecordingBrain(think_s=0.5)
    stt = ScriptedSTT(("What time is it?", 0.0), ("", 0.05))
    session, events, drain = talking_session(stt, brain)
    try:
        say_turn(session)
        await wait_for(lambda: brain.asked)
        session.conversation.interrupt()
        await asyncio.sleep(0.1)
        say_turn(session, 0.2)  # a cough, nothing to barge in on
        await wait_for(lambda: stt.calls == 2 and not session.conversation._turn_tasks)
        await asyncio.sleep(0.6)  # a second reply would have been asked for by now
        assert len(brain.asked) == 1
        assert not [e for e in events if e["type"] == "speech.started"]
    finally:
        drain.stop()
        await session.close()


async def test_the_clients_interrupt_while_a_turn_is_transcribed_withdraws_it_too() -> None:
    """Stop pressed after speaking, while the turn was still being transcribed, cancelled
    only replies that existed: the transcript came back and was answered, so the agent
    began to talk right after the user told it to stop. The turn is now withdrawn too; it
    stays in the history as context."""
    brain = RecordingBrain()
    stt = ScriptedSTT(("What time is it?", 0.3))
    session, events, drain = talking_session(stt, brain)
    try:
        say_turn(session)
        await asyncio.sleep(0.05)
        assert session.conversation.in_flight
        session.conversation.interrupt()
        await wait_for(lambda: stt.calls == 1 and not session.conversation._turn_tasks)
        await asyncio.sleep(0.3)
        assert brain.asked == [], "a reply was started after the client's interrupt"
        assert not [e for e in events if e["type"] == "speech.started"], events
        assert session.conversation.history == [{"role": "user", "content": "What time is it?"}]
    finally:
        drain.stop()
        await session.close()


async def test_the_clients_interrupt_withdraws_a_question_a_barge_in_left_open() -> None:
    """A barge-in that cuts a reply unheard leaves its question open for the next reply;
    the client's interrupt after that withdraws it as well: the barge-in's own turn, then
    transcribed, was answered with both, after Stop."""
    brain = RecordingBrain(think_s=0.5)
    stt = ScriptedSTT(("What time is it?", 0.0), ("Hmm", 0.3))
    session, events, drain = talking_session(stt, brain)
    try:
        say_turn(session)
        await wait_for(lambda: brain.asked)
        say_turn(session, 0.2)  # barges in on the reply being prepared: its question stays
        await asyncio.sleep(0.05)
        session.conversation.interrupt()  # Stop, while "Hmm" is transcribed
        await wait_for(lambda: stt.calls == 2 and not session.conversation._turn_tasks)
        await asyncio.sleep(0.6)
        assert len(brain.asked) == 1, brain.asked
        assert not [e for e in events if e["type"] == "speech.started"], events
    finally:
        drain.stop()
        await session.close()


async def test_a_turn_is_in_flight_from_its_end_to_its_reply_s_last_word() -> None:
    """What the shutdown's drain waits for (signaling/shutdown.py): a turn being transcribed,
    then its reply being prepared, then spoken, with no gap between them. The pipeline alone
    looks idle until the reply's first words: the drain used to close the session then."""
    brain = RecordingBrain(think_s=0.3)
    stt = ScriptedSTT(("What time is it?", 0.3))
    session, events, drain = talking_session(stt, brain)
    conversation = session.conversation
    try:
        assert not conversation.in_flight
        say_turn(session)
        pipeline_idle = 0
        while not [e for e in events if e["type"] == "speech.ended"]:
            assert conversation.in_flight, events
            pipeline_idle += not session.pipeline.busy
            await asyncio.sleep(0.01)
        assert pipeline_idle >= 20, pipeline_idle  # transcribing and thinking: ~0.6 s
        await wait_for(lambda: not conversation.in_flight, timeout=1)
    finally:
        drain.stop()
        await session.close()


async def test_transcripts_that_come_back_out_of_order_keep_the_order_spoken() -> None:
    """Bug: a long turn's slow transcript that came back after the next, short turn's was
    appended after it, and after the reply: the short turn was answered alone, in the
    wrong order ("What is my name?" before "My name is Ann."), and the long one never."""
    stt = ScriptedSTT(("My name is Ann.", 0.4), ("What is my name?", 0.0))
    brain = RecordingBrain()
    session, events, drain = talking_session(stt, brain)
    conversation = session.conversation
    try:
        say_turn(session, 3.0)
        say_turn(session, 0.5)
        await wait_for(lambda: stt.calls == 2 and not conversation._turn_tasks)
        await wait_for(lambda: [e for e in events if e["type"] == "speech.ended"], timeout=3)
        await asyncio.sleep(0.1)  # a second reply, if any, would have been asked for by now
    finally:
        drain.stop()
        await session.close()
    arrived = [e["text"] for e in events if e["type"] == "user.transcript"]
    assert arrived == ["What is my name?", "My name is Ann."]  # the short turn's came first
    said = [
        {"role": "user", "content": "My name is Ann."},
        {"role": "user", "content": "What is my name?"},
    ]
    assert brain.asked == [said]  # one reply, to both, in the order spoken
    assert conversation.history == [*said, {"role": "assistant", "content": "Sure."}]


class LoudVad:
    """A voice activity model that hears any loud window as speech (no torch)."""

    def reset(self) -> None:
        pass  # no memory of earlier windows

    async def probability(self, window: np.ndarray) -> float:
        return 1.0 if float(np.abs(window).max()) > 0.1 else 0.0


class LoudVadPool:
    async def new_vad(self) -> LoudVad:
        return LoudVad()


@pytest.mark.parametrize("how", ["track_ends", "closed"])
async def test_a_turn_the_microphone_ends_in_the_middle_of_still_ends(how: str) -> None:
    """Bug: a microphone track that ended mid-turn (the connection lost; a resumed one
    closes the old listener) never ended the turn: user_speaking stayed True, so no reply
    ever started again, and the client never got user.speech.ended."""
    from types import SimpleNamespace

    stt = ScriptedSTT(("What time is it?", 0.0))
    brain = RecordingBrain()
    session, events, drain = talking_session(stt, brain)
    conversation = session.conversation
    mic = ToneMicrophone(440)  # steady and loud: the user talks until the track ends
    try:
        session.listen(mic, SimpleNamespace(), LoudVadPool())  # type: ignore[arg-type]
        inbound = session.inbound
        assert inbound is not None
        await wait_for(lambda: conversation.user_speaking)
        await asyncio.sleep(0.3)
        if how == "track_ends":
            mic.stop()  # its peer connection closed
        else:
            await inbound.close()  # what a resumed session's new connection does to it
        await wait_for(lambda: not conversation.user_speaking, timeout=2)
        # The turn ends with what was heard of it, and is answered.
        await wait_for(lambda: brain.asked, timeout=2)
        assert not inbound.detector.speaking and inbound.stats.turns == 1
    finally:
        drain.stop()
        await session.close()
    (ended,) = [e for e in events if e["type"] == "user.speech.ended"]
    assert ended["duration_ms"] >= 300
    assert brain.asked == [[{"role": "user", "content": "What time is it?"}]]


def test_a_probability_exactly_at_the_threshold_is_speech() -> None:
    """Onset counts windows at or above vad_threshold: the threshold itself is speech."""
    settings = ListenSettings(min_speech_ms=0)
    detector = SpeechDetector(settings)
    assert run(detector, [settings.vad_threshold]) == [("started", 0, 0)]


def test_a_window_between_the_thresholds_does_not_reset_an_onset() -> None:
    """Hysteresis before the onset too: a window between vad_neg_threshold and vad_threshold
    neither counts as speech nor breaks the run of speech windows."""
    detector = SpeechDetector(ListenSettings(min_speech_ms=64))  # two windows
    assert run(detector, [0.9, 0.4, 0.9]) == [("started", 2, 1)]


def test_speech_inside_a_turn_restarts_the_end_of_turn_silence() -> None:
    """End of turn needs end_of_turn_silence_ms of silence in a row: a word between two
    short pauses keeps the turn going."""
    detector = SpeechDetector(ListenSettings(min_speech_ms=0, end_of_turn_silence_ms=96))
    events = run(detector, [0.9, 0.1, 0.1, 0.9, 0.1, 0.1, 0.9])
    assert events == [("started", 0, 0)]
    assert run(detector, [0.1, 0.1, 0.1]) == [("ended", 9, 6)]


def test_after_a_turn_a_new_onset_needs_the_minimum_speech_again() -> None:
    """The onset run starts from zero after each turn: a window between the thresholds, or
    a single loud click, right after a turn ended does not start the next one."""
    detector = SpeechDetector(ListenSettings(min_speech_ms=64, end_of_turn_silence_ms=64))
    assert [e[0] for e in run(detector, [0.9, 0.9, 0.1, 0.1])] == ["started", "ended"]
    assert run(detector, [0.4, 0.9, 0.1]) == []


async def test_with_barge_in_off_the_user_talking_does_not_cut_the_reply() -> None:
    """barge_in false (data channel ``config``): the user starting to talk leaves the reply
    being prepared alone; it is spoken to its end, not interrupted."""
    brain = RecordingBrain(think_s=0.3)
    session, events, drain = talking_session(ScriptedSTT(), brain)
    conversation = session.conversation
    conversation.barge_in = False
    try:
        conversation.ask("What time is it?")
        await wait_for(lambda: brain.asked)
        conversation.user_started(ActivityEvent(Activity.STARTED, 0))
        await wait_for(lambda: [e for e in events if e["type"] == "speech.ended"], timeout=3)
        [ended] = [e for e in events if e["type"] == "speech.ended"]
        assert not ended.get("interrupted") and conversation.stats.barge_ins == 0
    finally:
        drain.stop()
        await session.close()


async def test_no_reply_starts_while_the_user_is_talking_again() -> None:
    """A transcript that comes back while the user has started another turn waits: the
    reply starts once that turn ends, and answers both."""
    stt = ScriptedSTT(("What time is it?", 0.1), ("", 0.0))
    brain = RecordingBrain()
    session, _, drain = talking_session(stt, brain)
    conversation = session.conversation
    try:
        say_turn(session)
        conversation.user_started(ActivityEvent(Activity.STARTED, 0))  # talking again
        await wait_for(lambda: stt.calls == 1 and not conversation._turn_tasks)
        await asyncio.sleep(0.2)
        assert brain.asked == []
        conversation.user_ended(np.zeros(1_600, np.float32), ActivityEvent(Activity.ENDED, 0))
        await wait_for(lambda: brain.asked, timeout=3)
        assert brain.asked == [[{"role": "user", "content": "What time is it?"}]]
    finally:
        drain.stop()
        await session.close()


async def test_a_missing_speech_to_text_service_is_reported_once_per_session() -> None:
    """No --stt-url: the first turn gets an stt_unavailable error, later turns do not (the
    same alert at every turn would only bury the page)."""
    session = AgentSession("s", ToneEngine(), Config())
    events: list[dict[str, Any]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    conversation = session.conversation
    try:
        for _ in range(3):
            say_turn(session, 0.2)
            await wait_for(lambda: not conversation._turn_tasks)
        errors = [e for e in events if e["type"] == "error"]
        assert [e["code"] for e in errors] == ["stt_unavailable"]
        assert len([e for e in events if e["type"] == "user.speech.ended"]) == 3
    finally:
        await session.close()


async def test_chats_waiting_for_their_reply_are_bounded_by_the_utterance_queue() -> None:
    """Each chat waits (and costs an LLM call): at most max_queued_utterances may wait; the
    next is refused with queue_full."""
    from agent.speech import SpeechError

    brain = RecordingBrain(think_s=5.0)
    session, _, drain = talking_session(ScriptedSTT(), brain)
    conversation = session.conversation
    session.pipeline.settings = dataclasses.replace(
        session.pipeline.settings, max_queued_utterances=3
    )
    try:
        for i in range(3):
            conversation.ask(f"question {i}")
        with pytest.raises(SpeechError) as refused:
            conversation.ask("one too many")
        assert refused.value.code == "queue_full"
    finally:
        drain.stop()
        await session.close()


def test_the_history_keeps_the_last_max_history_messages() -> None:
    """What the brain is sent is bounded: past max_history_messages the oldest go."""
    session = AgentSession("s", ToneEngine(), Config())
    conversation = session.conversation
    conversation.services = dataclasses.replace(conversation.services, max_history_messages=3)
    for i in range(4):
        conversation._add_user(f"message {i}")
        assert len(conversation.history) == min(i + 1, 3)
    assert [m["content"] for m in conversation.history] == ["message 1", "message 2", "message 3"]
    conversation.discard()


class FailingFirstBrain(RecordingBrain):
    """Its first reply fails before a word (the LLM is down); later ones answer."""

    async def reply(self, history: list[Message]) -> AsyncIterator[str]:
        self.asked.append([dict(m) for m in history])
        if len(self.asked) == 1:
            raise ServiceError("llm_failed", "the LLM is down")
        yield "Sure."


async def test_a_failed_reply_followed_by_a_later_one_leaves_no_question_open() -> None:
    """A reply nobody heard reopens the user's last question only if no later reply answers
    it: here the next chat's reply (which sees both questions) does, so a cough after it
    gets no third reply."""
    stt = ScriptedSTT(("", 0.0))
    brain = FailingFirstBrain()
    session, events, drain = talking_session(stt, brain)
    conversation = session.conversation
    try:
        conversation.ask("What time is it?")
        conversation.ask("And the date?")
        await wait_for(lambda: [e for e in events if e["type"] == "speech.ended"], timeout=3)
        say_turn(session, 0.2)  # a cough
        await wait_for(lambda: stt.calls == 1 and not conversation._turn_tasks)
        await asyncio.sleep(0.3)  # a third reply would have been asked for by now
        assert len(brain.asked) == 2
        assert brain.asked[1] == [
            {"role": "user", "content": "What time is it?"},
            {"role": "user", "content": "And the date?"},
        ]
    finally:
        drain.stop()
        await session.close()


async def test_a_failed_replys_error_names_the_turn_or_chat_it_answers() -> None:
    """A reply's error carried only the reply's id, which the client never saw when the
    reply failed before it spoke: nothing tied it to the question. It now carries
    ``reply_to``: the voice turn's id, or the chat's own id (none for a chat without)."""
    brain = FailingFirstBrain()
    stt = ScriptedSTT(("what time is it", 0.0))
    session, events, drain = talking_session(stt, brain)
    try:
        say_turn(session, 0.5)
        await wait_for(lambda: any(e["type"] == "error" for e in events), timeout=3)
        (turn,) = [e for e in events if e["type"] == "user.speech.ended"]
        (error,) = [e for e in events if e["type"] == "error"]
        assert error["code"] == "llm_failed" and error["id"].startswith("reply-"), error
        assert error["reply_to"] == turn["id"], (error, turn)
        # A cough (a turn with no words) before the reply is asked: the reply it starts
        # answers the question before it, and names that one, not the cough.
        brain.asked.clear()
        stt.script.append(("", 0.0))
        say_turn(session, 0.2)
        await wait_for(lambda: len([e for e in events if e["type"] == "error"]) == 2, timeout=3)
        error = [e for e in events if e["type"] == "error"][1]
        assert (error["code"], error["reply_to"]) == ("llm_failed", turn["id"]), error
        brain.asked.clear()  # fails again: the chat's reply is its first one once more
        session.conversation.ask("and now?", question_id="q7")
        session.conversation.ask("still nothing?")  # answered: FailingFirstBrain's second
        await wait_for(lambda: len([e for e in events if e["type"] == "error"]) == 3, timeout=3)
        error = [e for e in events if e["type"] == "error"][2]
        assert (error["code"], error["reply_to"]) == ("llm_failed", "q7"), error
    finally:
        drain.stop()
        await session.close()


async def test_an_answer_that_starts_with_nothing_to_say_is_spoken_whole() -> None:
    """The answer's start without words (newlines, an emoji) is held, then sent with the
    first words: one caption, the emoji kept in it and in the history."""
    brain = TextlessBrain(["\n", "\U0001f44b ", "Hello", " there."])
    session, events, drain = talking_session(ScriptedSTT(), brain)
    try:
        reply_id = session.conversation.ask("Hi")
        ended = {"type": "speech.ended", "id": reply_id, "interrupted": False}
        await wait_for(lambda: ended in events, timeout=3)
        captions = [e["text"] for e in events if e["type"] == "speech.segment"]
        assert captions == ["\U0001f44b Hello there."], captions
        assert session.conversation.history[-1] == {
            "role": "assistant",
            "content": "\U0001f44b Hello there.",
        }
        assert not [e for e in events if e["type"] == "error"], events
    finally:
        drain.stop()
        await session.close()


async def test_reply_to_names_the_last_turn_spoken_though_its_transcript_came_first() -> None:
    """Transcripts come back out of order: the later turn's first. The reply answers both
    (it starts once every transcript is in) and named the turn whose transcript arrived
    last, so the page marked the earlier question failed and left the last one waiting."""
    brain = FailingFirstBrain()
    stt = ScriptedSTT(("What time is it?", 0.3), ("And the date?", 0.05))
    session, events, drain = talking_session(stt, brain)
    try:
        say_turn(session)
        say_turn(session)
        await wait_for(lambda: any(e["type"] == "error" for e in events), timeout=3)
        turns = [e["id"] for e in events if e["type"] == "user.speech.ended"]
        (error,) = [e for e in events if e["type"] == "error"]
        assert error["reply_to"] == turns[1], (error, turns)
        assert [m["content"] for m in brain.asked[0]] == ["What time is it?", "And the date?"]
    finally:
        drain.stop()
        await session.close()


class ScriptedBrain(RecordingBrain):
    """Answers the n-th question with the n-th list of deltas."""

    def __init__(self, *answers: list[str]) -> None:
        super().__init__()
        self.answers = list(answers)

    async def reply(self, history: list[Message]) -> AsyncIterator[str]:
        self.asked.append([dict(m) for m in history])
        for delta in self.answers[len(self.asked) - 1]:
            yield delta


async def test_a_playing_reply_is_sent_to_the_brain_as_it_is_spoken() -> None:
    """A reply still playing was sent to the brain as written, pieces the engine does not
    speak included; once played, the history holds only what was spoken. The brain saw one
    answer, then another (found by review)."""
    brain = ScriptedBrain(["\U0001f389\U0001f389. ", "Hello there, how are you today?"], ["Ok."])
    session, _, drain = talking_session(ScriptedSTT(), brain, ToneEngine(seconds_per_word=0.3))
    try:
        session.pipeline.say("one two three four five six", "before")  # plays first
        session.conversation.ask("Hi")  # written at once, heard after "before"
        session.conversation.ask("Fine?")  # asked while the first reply waits to play
        await wait_for(lambda: len(brain.asked) == 2, timeout=3)
        assert brain.asked[1][1] == {
            "role": "assistant",
            "content": "Hello there, how are you today?",
        }
    finally:
        drain.stop()
        await session.close()


async def test_the_brain_is_sent_settled_messages_only() -> None:
    """A turn still being transcribed has an empty slot in the history: a chat answered
    meanwhile does not send the brain that empty message."""
    stt = ScriptedSTT(("A long story.", 0.5))
    brain = RecordingBrain()
    session, _, drain = talking_session(stt, brain)
    try:
        say_turn(session)  # its transcript comes back in 0.5 s
        session.conversation.ask("Hello?")
        await wait_for(lambda: brain.asked)
        assert brain.asked[0] == [{"role": "user", "content": "Hello?"}]
    finally:
        drain.stop()
        await session.close()


def test_a_user_talking_is_heard_now_and_after_the_turn_when_it_ended() -> None:
    """The idle watchdog's view: while the user talks they are heard *now*; after the turn,
    at its end."""
    session = AgentSession("s", ToneEngine(), Config())
    conversation = session.conversation
    assert conversation.user_heard_at(50.0) < 0
    conversation.user_started(ActivityEvent(Activity.STARTED, 0))
    assert conversation.user_heard_at(1_000.0) == 1_000.0
    conversation._closed = True  # the turn's end is noted, nothing is transcribed
    conversation.user_ended(np.zeros(160, np.float32), ActivityEvent(Activity.ENDED, 0))
    later = time.monotonic() + 100.0
    ended = conversation.user_heard_at(later)
    assert ended < later and conversation.user_heard_at(later + 100.0) == ended
    conversation.discard()


async def test_replies_are_prepared_one_after_another() -> None:
    """Replies run one at a time, in order: the second chat's reply is not asked of the
    brain while the first is still being written."""
    brain = RecordingBrain(think_s=0.3)
    session, _, drain = talking_session(ScriptedSTT(), brain)
    try:
        session.conversation.ask("First?")
        session.conversation.ask("Second?")
        await asyncio.sleep(0.15)
        assert len(brain.asked) == 1
        await wait_for(lambda: len(brain.asked) == 2, timeout=3)
    finally:
        drain.stop()
        await session.close()


async def test_a_turn_transcribed_after_a_chat_s_reply_was_asked_comes_after_it() -> None:
    """Bug: a chat sent while a turn was being transcribed was answered first (the turn's
    slot was still empty), but the turn stayed before it in the history: the turn's own
    reply was asked with a history ending in the agent's reply to the chat (the echo
    brain said the chat's words twice, "What time is it?" never)."""
    stt = ScriptedSTT(("What time is it?", 0.4), ("My name is Ann.", 0.5))
    brain = RecordingBrain()
    session, _, drain = talking_session(stt, brain)
    conversation = session.conversation
    try:
        say_turn(session)
        say_turn(session)
        conversation.ask("Hello?")
        await wait_for(lambda: len(brain.asked) == 2, timeout=3)
        hello = {"role": "user", "content": "Hello?"}
        sure = {"role": "assistant", "content": "Sure."}
        assert brain.asked == [
            [hello],
            [
                hello,
                sure,
                {"role": "user", "content": "What time is it?"},
                {"role": "user", "content": "My name is Ann."},
            ],
        ]
    finally:
        drain.stop()
        await session.close()


class NumberingBrain(RecordingBrain):
    """Answers the n-th request with "Answer n." (in two deltas)."""

    async def reply(self, history: list[Message]) -> AsyncIterator[str]:
        self.asked.append([dict(m) for m in history])
        await asyncio.sleep(self.think_s)
        yield "Answer "
        yield f"{len(self.asked)}."


async def test_each_reply_is_asked_with_the_conversation_up_to_its_own_question() -> None:
    """Bug: three chats sent together were each answered with all three questions and none
    of the answers: the first reply answered "Third?" (the echo brain spoke "Third?" three
    times), and the later ones did not know what the agent had just said, which was still
    being played (a reply's history slot is filled only when its utterance ends)."""
    brain = NumberingBrain(think_s=0.05)
    # The first reply's audio is still to be played when the second one is asked for.
    engine = ToneEngine(seconds_per_word=0.05, first_chunk_delay_s=0.5)
    session, events, drain = talking_session(ScriptedSTT(), brain, engine)
    conversation = session.conversation
    try:
        for question in ("First?", "Second?", "Third?"):
            conversation.ask(question)
        await wait_for(lambda: len(brain.asked) == 3, timeout=3)
        assert not [e for e in events if e["type"] == "speech.segment"]  # nothing played yet
        first = {"role": "user", "content": "First?"}
        second = {"role": "user", "content": "Second?"}
        assert brain.asked == [
            [first],
            [first, {"role": "assistant", "content": "Answer 1."}, second],
            [
                first,
                {"role": "assistant", "content": "Answer 1."},
                second,
                {"role": "assistant", "content": "Answer 2."},
                {"role": "user", "content": "Third?"},
            ],
        ]
    finally:
        drain.stop()
        await session.close()


async def test_turns_answered_together_reach_a_strict_chat_template_alternating() -> None:
    """Bug: two turns answered by one reply went to the LLM as two user messages in a row,
    which the chat templates of Llama 2, Mistral or Gemma refuse (vLLM: HTTP 400 "roles
    must alternate"): that reply failed, and every later one while the pair was in the
    history. Neighbours of one role are now sent joined, and a history trimmed to start
    with a reply starts with the next question."""
    stt = ScriptedSTT(("What time is it?", 0.1), ("And the date?", 0.0))
    async with FakeLLM(strict_roles=True) as llm:
        session, events, drain = talking_session(stt, RecordingBrain())
        conversation = session.conversation
        conversation.services = dataclasses.replace(
            conversation.services, llm_base_url=llm.url, system_prompt="Be brief."
        )
        conversation._brain = None  # the LLM brain, on the fake server
        try:
            say_turn(session)
            conversation.user_started(ActivityEvent(Activity.STARTED, 0))  # talking again
            await wait_for(lambda: stt.calls == 1 and not conversation._turn_tasks)
            conversation.user_ended(np.zeros(1_600, np.float32), ActivityEvent(Activity.ENDED, 0))
            await wait_for(lambda: [e for e in events if e["type"] == "speech.ended"], timeout=3)
            assert not [e for e in events if e["type"] == "error"], events
            assert llm.requests[0]["messages"] == [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What time is it?\nAnd the date?"},
            ]
        finally:
            drain.stop()
            await session.close()
    trimmed = [
        {"role": "assistant", "content": "It is noon."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are"},
        {"role": "assistant", "content": "welcome."},
        {"role": "user", "content": "Bye."},
    ]
    assert alternating(trimmed) == [
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."},
        {"role": "user", "content": "Bye."},
    ]


class TurnRecorder:
    """A Listener that keeps what the inbound audio reports."""

    def __init__(self) -> None:
        self.started: list[ActivityEvent] = []
        self.ended: list[tuple[np.ndarray, ActivityEvent]] = []

    def user_started(self, event: ActivityEvent) -> None:
        self.started.append(event)

    def user_ended(self, audio: np.ndarray, event: ActivityEvent) -> None:
        self.ended.append((audio, event))


def test_a_turn_s_audio_starts_with_its_preroll_before_the_onset_windows() -> None:
    """The turn handed to speech-to-text holds preroll_ms of audio before the speech began,
    then the onset's own windows (the first word's start), then the rest of the turn."""
    from agent.inbound import InboundAudio

    settings = ListenSettings(min_speech_ms=64, preroll_ms=64, end_of_turn_silence_ms=64)
    listener = TurnRecorder()
    inbound = InboundAudio(None, None, settings, listener)  # type: ignore[arg-type]
    windows = [np.full(512, i, np.float32) for i in range(10)]
    for i, p in enumerate([0.0, 0.0, 0.0, 0.0, 0.9, 0.9, 0.9, 0.1, 0.1]):
        inbound._on_window(windows[i], float(i), p)
    [(audio, _)] = listener.ended
    assert [int(v) for v in audio[::512]] == [2, 3, 4, 5, 6, 7, 8]
    assert inbound.stats.last_onset_frame_at == 4.0  # the first speech window's arrival


class EveryTurnSaysHello:
    """Speech-to-text that hears "hello" in every turn."""

    def __init__(self) -> None:
        self.calls = 0

    async def transcribe(self, audio: np.ndarray) -> str:
        self.calls += 1
        return "hello"


async def test_voice_turns_whose_replies_cannot_start_are_bounded_like_chat() -> None:
    """Barge-in off and a text.delta stream the client never ends: every voice turn's
    transcript started a reply that waited behind the one before, never refused (chat is,
    at max_queued_utterances): a task and an id per turn, for as long as the session lived
    (found by review: 2000 turns, 2000 tasks). Now a turn past the limit starts no reply,
    says queue_full, and stays unanswered: the next reply answers it too."""
    session = AgentSession("s", ToneEngine(seconds_per_word=0.05), Config())
    events: list[dict[str, Any]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    stt = EveryTurnSaysHello()
    conversation = session.conversation
    conversation._transcriber = stt  # type: ignore[assignment]
    session.pipeline.start()
    drain = Drain(session.pipeline)
    limit = session.config.speech.max_queued_utterances
    turns = limit + 40
    try:
        session.handle_message('{"type": "config", "barge_in": false}')
        session.handle_message('{"type": "text.delta", "delta": "Let me think"}')  # never ended
        audio = np.zeros(160, np.float32)
        for _ in range(turns):
            conversation.user_started(ActivityEvent(Activity.STARTED, 0))
            conversation.user_ended(audio, ActivityEvent(Activity.ENDED, 0))
            await asyncio.sleep(0)  # the turn's transcript comes back, its reply starts
        await wait_for(lambda: stt.calls == turns and not conversation._turn_tasks, timeout=30)
        assert len(conversation._unopened) <= limit
        assert sum(not t.done() for t in conversation._reply_tasks) <= limit
        refused = [e for e in events if e.get("code") == "queue_full"]
        assert len(refused) == turns - limit, len(refused)
        assert conversation._unanswered  # the refused turns wait for the next reply
    finally:
        drain.stop()
        await session.close()


async def test_a_turn_the_microphone_s_end_cuts_short_ends_a_moment_later() -> None:
    """The microphone's track ends (the client's RTCP BYE) mid-turn: the turn ends after
    TRACK_END_SETTLE_S, not at once, so that a connection closing with it is seen first and
    user.speech.ended waits for the resume instead of going out on a dying channel."""
    from aiortc.mediastreams import MediaStreamError

    from agent.inbound import TRACK_END_SETTLE_S, InboundAudio

    class EndedTrack:
        async def recv(self) -> None:
            raise MediaStreamError

    settings = ListenSettings(min_speech_ms=64, preroll_ms=64, end_of_turn_silence_ms=64)
    listener = TurnRecorder()
    inbound = InboundAudio(EndedTrack(), None, settings, listener)  # type: ignore[arg-type]
    for i in range(4):
        inbound._on_window(np.zeros(512, np.float32), float(i), 0.9)
    assert listener.started and inbound.detector.speaking
    reader = asyncio.get_running_loop().create_task(inbound._read())
    await asyncio.sleep(TRACK_END_SETTLE_S / 2)
    assert listener.ended == []
    await asyncio.wait_for(reader, TRACK_END_SETTLE_S * 2)
    assert len(listener.ended) == 1


class GoesQuiet(ToneMicrophone):
    """Loud for ``frames`` frames, then nothing at all (the track stays live)."""

    def __init__(self, frames: int) -> None:
        super().__init__(440)
        self.frames = frames

    async def recv(self) -> Any:
        if self.frames == 0:
            await asyncio.Event().wait()
        self.frames -= 1
        return await super().recv()


async def test_a_turn_the_microphone_goes_quiet_in_the_middle_of_ends() -> None:
    """Bug: a client that stopped sending mid-turn without ending its track (a stopped or
    replaced track sends no RTCP BYE) left the turn open for good: the detector counts
    silence in windows, and no window came. No reply ever started, and the user "talking"
    kept the session from its idle timeout. Found by review. No audio for the end-of-turn
    silence now ends the turn with what was heard of it."""
    from types import SimpleNamespace

    from agent.inbound import QUIET_ENDS_TURN_MIN_S

    stt = ScriptedSTT(("What time is it?", 0.0))
    brain = RecordingBrain()
    session, events, drain = talking_session(stt, brain)
    conversation = session.conversation
    try:
        session.listen(GoesQuiet(25), SimpleNamespace(), LoudVadPool())  # type: ignore[arg-type]
        await wait_for(lambda: conversation.user_speaking, timeout=2)
        started = time.monotonic()
        await wait_for(lambda: not conversation.user_speaking, timeout=3)
        # Not at a mere gap: the network's jitter is not the user falling silent.
        assert time.monotonic() - started >= QUIET_ENDS_TURN_MIN_S - 0.5
        await wait_for(lambda: brain.asked, timeout=2)
    finally:
        drain.stop()
        await session.close()
    (ended,) = [e for e in events if e["type"] == "user.speech.ended"]
    assert ended["duration_ms"] >= 300


async def test_a_microphone_quiet_with_its_whole_connection_leaves_the_turn_to_the_resume() -> None:
    """Bug: the quiet-microphone watch ended a turn 1 s after the last frame even when
    nothing at all came from the peer any more (its network dropped: no RTCP, no data
    channel). The turn's user.speech.ended and the reply's first events went out on a data
    channel that was already dead, and the reply played to nobody: the session is detached
    (playout paused) only after --rtcp-timeout. The connection's loss ends such a turn
    (its track ends; a resume's stop_listening) and its events wait for the resume. Only a
    peer still heard after its microphone's last frame (a client that stopped its track)
    has its turn ended by the watch."""
    from types import SimpleNamespace

    from agent.inbound import QUIET_ENDS_TURN_MIN_S

    heard_at = [time.monotonic()]
    session, _events, drain = talking_session(ScriptedSTT(("Hello", 0.0)), RecordingBrain())
    conversation = session.conversation
    try:
        mic = GoesQuiet(25)
        pool = LoudVadPool()
        session.listen(mic, SimpleNamespace(), pool, heard=lambda: heard_at[0])  # type: ignore[arg-type]
        await wait_for(lambda: conversation.user_speaking, timeout=2)
        await wait_for(lambda: mic.frames == 0, timeout=2)
        await asyncio.sleep(QUIET_ENDS_TURN_MIN_S * 2.5)
        assert conversation.user_speaking  # the peer went silent as a whole: not ended here
        heard_at[0] = time.monotonic()  # RTCP again: the peer is there, its microphone not
        await wait_for(lambda: not conversation.user_speaking, timeout=QUIET_ENDS_TURN_MIN_S * 3)
    finally:
        drain.stop()
        await session.close()


class TextlessBrain(RecordingBrain):
    """Answers with ``deltas`` that hold no text: none at all (an empty completion, or only
    tool calls), or only whitespace (the newlines an LLM sends before its tool calls)."""

    def __init__(self, deltas: list[str]) -> None:
        super().__init__()
        self.deltas = deltas

    async def reply(self, history: list[Message]) -> AsyncIterator[str]:
        self.asked.append([dict(m) for m in history])
        for delta in self.deltas:
            yield delta


@pytest.mark.parametrize(
    "deltas",
    [
        [],
        ["\n\n", " "],
        ["\U0001f44d"],
        ["\u2026", " \u2014", "\U0001f389"],
        # Its words come only past the 5000-character limit: opened on the dashes it was a
        # silent utterance never settled, told "spoken up to the limit" (found by review).
        ["-" * 1000] * 4 + ["-" * 999, "------ Hello there, here is the answer."],
    ],
    ids=["nothing", "whitespace", "emoji", "marks", "words_past_the_limit"],
)
async def test_an_answer_with_no_text_is_an_error_not_silence(deltas: list[str]) -> None:
    """A brain answer without any text (an empty completion; an LLM that only calls tools)
    was spoken as nothing and told as nothing: the client that asked heard of nothing
    (found by review). An answer of only whitespace opened an utterance that said nothing:
    speech.started and speech.ended, no error (found by the next review). Both are an
    ``llm_empty`` error with the reply's id; the question stays open, as for a reply nobody
    heard, and the next reply answers it."""
    session, events, drain = talking_session(ScriptedSTT(), TextlessBrain(deltas))
    try:
        reply_id = session.conversation.ask("Anyone there?")
        await wait_for(lambda: any(e["type"] == "error" for e in events), timeout=2)
        (error,) = [e for e in events if e["type"] == "error"]
        assert (error["code"], error["id"]) == ("llm_empty", reply_id), error
        assert not [e for e in events if e["type"].startswith("speech.")], events
        assert session.conversation.history == [{"role": "user", "content": "Anyone there?"}]
        assert session.conversation._replies == {}  # settled, nothing kept for it
        brain = RecordingBrain()
        session.conversation._brain = brain
        session.conversation.ask("Hello?")
        await wait_for(lambda: brain.asked, timeout=2)
        # Both questions, the first unanswered (LLMBrain joins them for the wire).
        assert [m["content"] for m in brain.asked[0]] == ["Anyone there?", "Hello?"]
    finally:
        drain.stop()
        await session.close()


async def test_replies_asked_together_past_the_history_s_length_answer_their_own_question() -> None:
    """Bug: chats sent together, more than half the history's length (40 messages; 32
    may wait), had the first replies' questions and slots trimmed away before they were
    asked: such a reply, its slot not found, was asked with the whole history, every later
    question included (the echo brain spoke the last question once per such reply), the
    bug a reply asked "up to its own slot" was to end (found by review)."""
    brain = NumberingBrain()
    session, _events, drain = talking_session(ScriptedSTT(), brain)
    conversation = session.conversation
    limit = conversation.services.max_history_messages
    questions = [f"Question {n}?" for n in range(limit // 2 + 5)]
    try:
        for question in questions:
            conversation.ask(question)
        await wait_for(lambda: len(brain.asked) == len(questions), timeout=5)
        for question, asked in zip(questions, brain.asked, strict=True):
            assert asked, question
            assert asked[-1] == {"role": "user", "content": question}, (question, asked)
            assert len(asked) <= limit
        assert len(conversation.history) <= limit
    finally:
        drain.stop()
        await session.close()


async def test_a_reply_the_engine_fails_to_speak_names_the_question_it_answers() -> None:
    """The brain's errors named the question (``reply_to``), the engine's did not: a reply
    whose speech failed (``tts_failed``) left the client nothing to tie it to the chat."""
    engine = FailingEngine(seconds_per_word=0.05)
    engine.mode = "start"
    session, events, drain = talking_session(ScriptedSTT(), RecordingBrain(), engine)
    try:
        reply_id = session.conversation.ask("hello?", question_id="q1")
        await wait_for(lambda: any(e["type"] == "error" for e in events), timeout=3)
        (error,) = [e for e in events if e["type"] == "error"]
        assert (error["code"], error["id"], error["reply_to"]) == ("tts_failed", reply_id, "q1")
        # A say's failure answers no question: nothing is added to it.
        session.pipeline.say("plain words", "s1")
        await wait_for(lambda: len([e for e in events if e["type"] == "error"]) == 2, timeout=3)
        error = [e for e in events if e["type"] == "error"][1]
        assert error["id"] == "s1" and "reply_to" not in error, error
    finally:
        drain.stop()
        await session.close()


def test_a_streamed_reply_cut_at_the_text_limit_ends_between_words() -> None:
    """An LLM's tokens start with their space (" world"): the delta crossing the limit had
    its only space first, and the cut sent " wo": the reply ended in half a word."""
    session = AgentSession("s", ToneEngine(), Config())
    limit = session.pipeline.settings.max_text_chars
    opened = Reply("r", {"role": "assistant", "content": ""}, chars=limit - 3, opened=True)
    assert session.conversation._within_limit(opened, " world") == (" ", True)
    assert session.conversation._within_limit(opened, "ab") == ("ab", False)


def test_a_reply_cut_before_it_opened_keeps_its_words() -> None:
    """A whole answer over the limit whose only whitespace is the newlines it starts with
    (many models do; Chinese has no spaces) was cut to "\n\n": a reply of nothing. It is
    cut at the limit itself then."""
    session = AgentSession("s", ToneEngine(), Config())
    limit = session.pipeline.settings.max_text_chars
    unopened = Reply("r", {"role": "assistant", "content": ""})
    cut, past = session.conversation._within_limit(unopened, "\n\n" + "x" * 6000)
    assert past and len(cut) == limit and session.pipeline.speakable(cut)


def test_a_whole_answer_without_spaces_after_a_first_line_keeps_its_words() -> None:
    """Chinese has no spaces: a whole answer "回答：\n" + 6000 characters was cut back to its
    first line, 4 of the 5000 characters it could say. The cut goes back to a space only
    when that drops a word's worth."""
    session = AgentSession("s", ToneEngine(), Config())
    limit = session.pipeline.settings.max_text_chars
    unopened = Reply("r", {"role": "assistant", "content": ""})
    cut, past = session.conversation._within_limit(unopened, "回答：\n" + "天气很好" * 1500)
    assert past and len(cut) == limit


@pytest.mark.parametrize("how", ["interrupt", "barge-in"])
async def test_every_reply_being_prepared_is_cancelled_not_only_the_newest(how: str) -> None:
    """Two questions asked while the brain thinks: the client's interrupt (or the user
    barging in) cancels both replies. Cancelling only the newest left the first to open its
    stream a moment later and speak after the interrupt."""
    brain = RecordingBrain(think_s=0.3)
    session, events, drain = talking_session(ScriptedSTT(), brain)
    conversation = session.conversation
    try:
        conversation.ask("What time is it?")
        conversation.ask("And the weather?")
        await wait_for(lambda: len(brain.asked) == 1)  # the first thinks, the second waits
        tasks = list(conversation._reply_tasks)
        assert len(tasks) == 2
        if how == "interrupt":
            conversation.interrupt()
        else:
            conversation.user_started(ActivityEvent(Activity.STARTED, 0))
        await asyncio.sleep(0.6)
        assert all(task.cancelled() for task in tasks), tasks
        assert not [e for e in events if e["type"] == "speech.started"], events
    finally:
        drain.stop()
        await session.close()


def echo_session(stt: ScriptedSTT, engine: ToneEngine) -> tuple[AgentSession, list[Any], Drain]:
    session = AgentSession("s", engine, Config())  # no --llm-url: the echo brain
    events: list[dict[str, Any]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    session.conversation._transcriber = stt  # type: ignore[assignment]
    session.pipeline.start()
    assert isinstance(session.conversation.brain, EchoBrain)
    return session, events, Drain(session.pipeline)


async def test_the_echo_brain_says_back_every_turn_its_reply_answers() -> None:
    """README, Conversation: the reply "answers every turn since the last reply" ("the
    next reply answers both"), and the echo brain (the default, no --llm-url) "speaks the
    transcript back". A barge-in that cuts the first turn's echo before it is heard leaves
    that turn open for the next reply (README item 5), but EchoBrain.reply speaks only
    the last user message: "My name is Ann." is never said back, although its transcript
    was shown and the reply was meant to answer it (found by review)."""
    engine = ToneEngine(seconds_per_word=0.05, first_chunk_delay_s=0.5)
    stt = ScriptedSTT(("My name is Ann.", 0.0), ("What is my name?", 0.05))
    session, events, drain = echo_session(stt, engine)
    try:
        say_turn(session)  # "My name is Ann.": its echo is being prepared, not heard yet
        await wait_for(lambda: session.pipeline.busy)
        say_turn(session, 0.5)  # barges in (unheard: the question stays open), then ends
        await wait_for(
            lambda: [e for e in events if e["type"] == "speech.ended" and not e["interrupted"]],
            timeout=5,
        )
        said = " ".join(e["text"] for e in events if e["type"] == "speech.segment")
        assert "What is my name?" in said, events
        assert "My name is Ann." in said, said
    finally:
        drain.stop()
        await session.close()


async def test_the_echo_brain_says_back_a_turn_whose_transcript_came_late() -> None:
    """The same without a barge-in: the first turn's transcript comes back after the user
    began the next (README: "a transcript that arrives after the user started another turn
    gets no reply of its own, the next reply answers both"); the echo says only the second."""
    stt = ScriptedSTT(("My name is Ann.", 0.3), ("What is my name?", 0.0))
    session, events, drain = echo_session(stt, ToneEngine(seconds_per_word=0.05))
    try:
        say_turn(session)
        say_turn(session, 0.5)
        await wait_for(lambda: [e for e in events if e["type"] == "speech.ended"], timeout=5)
        await asyncio.sleep(0.2)
        said = [e["text"] for e in events if e["type"] == "speech.segment"]
        assert " ".join(said).count("My name is Ann.") == 1, said
    finally:
        drain.stop()
        await session.close()


async def test_the_echo_brain_echoes_a_named_room_members_chat_without_their_name() -> None:
    """README: **Ask** -- "the agent's brain answers it: the LLM with --llm-url, else it is
    echoed". In a room, a named member's chat is put in the history as "Ann: ..." so that an
    LLM can tell the askers apart; the echo brain says that history message back, so the
    room heard (and saw captioned) "Ann: Hello everyone" instead of the words that were
    typed (found by review). An LLM still gets the name, and nothing but role and content."""
    config = Config()
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(ToneEngine(seconds_per_word=0.01), config.speech, events.append)
    conversation = Conversation(pipeline, config.listen, config.services, events.append)
    # As room.py wires it: the pipeline's events go through observe() too.
    pipeline._emit = lambda e: (conversation.observe(e), events.append(e))  # type: ignore[method-assign]
    pipeline.start()
    drain = Drain(pipeline)
    try:
        conversation.ask("Hello everyone", asker="Ann", question_id="q1")
        await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
        captions = [e["text"] for e in events if e["type"] == "speech.segment"]
        assert " ".join(captions) == "Hello everyone", captions
        assert alternating(conversation.history)[0] == {
            "role": "user",
            "content": "Ann: Hello everyone",
        }
    finally:
        drain.stop()
        await conversation.close()
        await pipeline.close()
