"""Promises of listening and the conversation (README "Talking to the agent", barge-in,
speech-to-text, the LLM) that no other test held the code to: found by hand mutation testing
of agent/inbound.py, vad.py, receive_buffer.py, turns.py, brain.py, stt.py and
conversation_config.py. Each test fails with the mutation its docstring names."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import time
import wave
from typing import Any

import numpy as np
import pytest
import soxr

from agent.brain import EchoBrain
from agent.config import Config
from agent.conversation_config import VAD_WINDOW_MS, ListenSettings, ServiceSettings
from agent.llm import Message
from agent.receive_buffer import MAX_MISORDER, PromptAudioBuffer
from agent.session import AgentSession
from agent.stt import wav_bytes
from agent.turns import Reply
from agent.vad import Activity, ActivityEvent, SpeechDetector
from tests.doubles import FailingEngine, ToneEngine
from tests.test_conversation_units import RecordingBrain, ScriptedSTT, say_turn, talking_session
from tests.test_receive_buffer import feed, packet
from tests.test_speech_pipeline import Drain, wait_for


def _events(detector: SpeechDetector, probabilities: list[float]) -> list[tuple[str, int]]:
    out = []
    for p in probabilities:
        event = detector.push(p)
        if event is not None:
            out.append((event.kind.value, detector.index))
    return out


# --- the speech detector: --min-speech-ms and --end-of-turn-ms are minimums ------------------
def test_min_speech_is_rounded_up_to_whole_windows_never_down() -> None:
    """README: `--min-speech-ms` is "speech this long (whole 32 ms windows, at least one)";
    ListenSettings: "Rounded up". 40 ms needs two windows: one loud window (a click, 32 ms)
    is shorter than the minimum and must not start a turn (nor barge in).
    Mutation: vad.py onset_windows ``math.ceil`` -> ``int`` (one window: the click starts)."""
    detector = SpeechDetector(ListenSettings(min_speech_ms=VAD_WINDOW_MS + 8))
    assert _events(detector, [0.1, 0.9, 0.1, 0.1]) == []  # 32 ms of speech: too short
    assert _events(detector, [0.9, 0.9]) == [("started", 5)]


def test_a_turn_ends_after_no_less_silence_than_end_of_turn_ms() -> None:
    """README: `--end-of-turn-ms` (600) is the "silence that ends the user's turn". 600 ms is
    18.75 windows: a pause of 18 windows (576 ms) must not end the turn, the 19th does.
    Mutation: vad.py silence_windows ``math.ceil`` -> ``int`` (the user's 580 ms pause
    ended their turn, and the rest of the sentence became a new turn)."""
    settings = ListenSettings()  # the defaults: min 32 ms of speech, 600 ms of silence
    assert settings.end_of_turn_silence_ms == 600
    detector = SpeechDetector(settings)
    assert _events(detector, [0.9]) == [("started", 0)]
    assert _events(detector, [0.1] * 18) == [], "the turn ended before 600 ms of silence"
    assert _events(detector, [0.1]) == [("ended", 19)]
    assert Activity.ENDED.value == "ended"


def test_the_silence_threshold_may_equal_the_speech_threshold() -> None:
    """The flag's own rule (--vad-neg-threshold "must be above 0 and at most the VAD
    threshold"): equal thresholds (no hysteresis band) are a valid setting.
    Mutation: conversation_config.py ``<= self.vad_threshold`` -> ``<`` (refused at start)."""
    settings = ListenSettings(vad_threshold=0.5, vad_neg_threshold=0.5)
    detector = SpeechDetector(settings)
    assert _events(detector, [0.5, 0.49]) == [("started", 0)]
    with pytest.raises(ValueError):
        ListenSettings(vad_threshold=0.5, vad_neg_threshold=0.51)


# --- speech-to-text: the WAV a turn is sent as ------------------------------------------------
def _pcm(wav: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(wav)) as reader:
        assert (reader.getnchannels(), reader.getsampwidth(), reader.getframerate()) == (
            1,
            2,
            16_000,
        )
        return np.frombuffer(reader.readframes(reader.getnframes()), "<i2")


def test_a_loud_turn_is_clipped_in_its_wav_not_wrapped_around() -> None:
    """The turn's 16 kHz audio comes out of soxr, which overshoots full scale on loud,
    clipped input (a full-scale square wave peaks at ~1.16 after 48 -> 16 kHz). Those
    samples must clip at full scale in the 16-bit WAV sent to STT, not wrap to the
    opposite sign (loud, crackling garbage where the user shouted).
    Mutation: stt.py wav_bytes without ``np.clip`` (1.5 became -16386)."""
    square = np.tile(np.r_[np.ones(48), -np.ones(48)], 50).astype(np.float32) * 0.99997
    resampled = soxr.ResampleStream(48_000, 16_000, 1, dtype="float32").resample_chunk(square)
    assert np.abs(resampled).max() > 1.0  # what the inbound path really hands the turn
    pcm = _pcm(wav_bytes(resampled))
    assert np.all(pcm[resampled > 0.5] > 0) and np.all(pcm[resampled < -0.5] < 0)
    assert _pcm(wav_bytes(np.array([1.5, -1.5, 0.5], np.float32))).tolist() == [
        32767,
        -32767,
        16383,
    ]


# --- the echo brain ------------------------------------------------------------------------------
async def test_the_echo_brain_says_back_the_turns_it_answers_in_the_order_spoken() -> None:
    """README: each turn keeps its place "in the order spoken", and a reply "answers every
    turn since the last reply"; the echo brain speaks the transcript back: both turns, in
    that order ("My name is Ann. What is my name?", not the question first).
    Mutation: brain.py EchoBrain ``" ".join(reversed(unanswered))`` -> ``join(unanswered)``."""
    history: list[Message] = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "My name is Ann."},
        {"role": "user", "content": "What is my name?"},
    ]
    said = [delta async for delta in EchoBrain().reply(history)]
    assert said == ["My name is Ann. What is my name?"]


# --- the microphone's receive buffer ------------------------------------------------------------
def test_a_packet_exactly_max_misorder_behind_is_late_not_a_restart() -> None:
    """A packet MAX_MISORDER (100) behind the next one due is a late one (aiortc's bound,
    which the module says it shares), dropped: not a sender restart that releases two-second
    old audio into the VAD, throws away the sequence and counts ~65k packets given up.
    Mutation: receive_buffer.py ``ahead >= SEQUENCE_SPACE - MAX_MISORDER`` -> ``>``."""
    buffer = PromptAudioBuffer()
    assert feed(buffer, list(range(1000, 1010))) == [(s, s) for s in range(1000, 1010)]
    stale = 1010 - MAX_MISORDER
    pli, frame = buffer.add(packet(stale))
    assert (pli, frame) == (False, None)
    assert buffer.dropped_late == 1 and buffer.given_up == 0
    assert feed(buffer, [1010, 1011]) == [(1010, 1010), (1011, 1011)]
    assert buffer.given_up == 0


# --- the conversation (agent/turns.py) -----------------------------------------------------------
def test_a_reply_exactly_at_the_text_limit_is_spoken_whole_without_an_error() -> None:
    """README: a text stream, a reply's included, "is spoken up to" 5000 characters and
    ``text_too_long`` is "over 5000 characters". A reply whose last delta lands exactly on
    the limit is within it: said whole, not cut back to its last space with an error.
    Mutation: turns.py _within_limit ``len(delta) <= room`` -> ``<``."""
    session = AgentSession("s", ToneEngine(), Config())
    limit = session.pipeline.settings.max_text_chars
    opened = Reply("r", {"role": "assistant", "content": ""}, chars=limit - 6, opened=True)
    assert session.conversation._within_limit(opened, " world") == (" world", False)
    unopened = Reply("r2", {"role": "assistant", "content": ""})
    whole = "word " * (limit // 5)
    assert len(whole) == limit
    assert session.conversation._within_limit(unopened, whole) == (whole, False)


def test_a_reply_cut_at_the_text_limit_ends_at_a_line_break_too() -> None:
    """A reply cut at the limit ends between words; an LLM's line break is such a place as
    much as a space ("...\\nwonderful" crossing the limit is cut after the newline, not
    as "\\nwonde").
    Mutation: turns.py _within_limit ``gap = max(head.rfind(" "), head.rfind("\\n"))`` ->
    ``head.rfind(" ")``."""
    session = AgentSession("s", ToneEngine(), Config())
    limit = session.pipeline.settings.max_text_chars
    opened = Reply("r", {"role": "assistant", "content": ""}, chars=limit - 8, opened=True)
    assert session.conversation._within_limit(opened, "ab\nwonderful") == ("ab\n", True)


class _FailsThenWritesOn:
    """A brain whose first sentence comes at once and the rest a moment later."""

    name = "two-part"

    async def reply(self, history: list[Message]) -> Any:
        yield "Hello there. "
        yield "How are you? "  # the first sentence is complete: it goes to the engine
        await asyncio.sleep(0.3)
        yield "And some more words."


async def test_a_reply_the_engine_fails_on_gets_its_tts_failed_alone() -> None:
    """README: a stream the engine fails on "is ended" with its error (``tts_failed``), "and
    the rest is not asked for". The reply's later deltas are refused by the pipeline
    (``stream_refused``), which is the engine's failure again: the client gets the one
    ``tts_failed`` for the reply, not a second error ``stream_refused`` for the same reply.
    Mutation: turns.py _run_reply reports every SpeechError (the ``stream_refused`` check
    dropped)."""
    engine = FailingEngine(seconds_per_word=0.05)
    engine.mode = "start"
    session = AgentSession("s", engine, Config())
    events: list[dict[str, Any]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    session.conversation._brain = _FailsThenWritesOn()
    session.pipeline.start()
    drain = Drain(session.pipeline)
    try:
        reply_id = session.conversation.ask("hello?", question_id="q1")
        await wait_for(lambda: any(e["type"] == "error" for e in events), timeout=3)
        await wait_for(lambda: not session.conversation.agent_active, timeout=3)
        await asyncio.sleep(0.1)
        errors = [
            (e["code"], e.get("id"), e.get("reply_to")) for e in events if e["type"] == "error"
        ]
        assert errors == [("tts_failed", reply_id, "q1")], errors
    finally:
        drain.stop()
        await session.close()


def test_a_turn_is_using_the_session_until_it_ends_not_only_while_it_lasts() -> None:
    """README, idle timeout: talking (from user.speech.started to the end of the turn) is
    using the session even while the agent stays silent; turns.py: the end is "kept past the
    turn: one that begins and ends between two of the idle watchdog's looks still counts".
    Mutation: turns.py user_ended without ``self._user_spoke_at = time.monotonic()`` (a
    short "yes" between two looks was never seen, and the session timed out as idle)."""
    session = AgentSession("s", ToneEngine(), Config())
    conversation = session.conversation
    conversation.user_started(ActivityEvent(Activity.STARTED, 0))
    conversation._closed = True  # nothing is transcribed
    before = time.monotonic()
    conversation.user_ended(np.zeros(160, np.float32), ActivityEvent(Activity.ENDED, 0))
    after = time.monotonic()
    assert before <= conversation.user_heard_at(after + 5.0) <= after
    conversation.discard()


async def test_voice_turns_keep_the_history_to_its_limit_and_the_brain_sees_no_more() -> None:
    """README: "The last 40 messages are kept" (``max_history_messages``). Voice turns whose
    replies cannot start (barge-in off, the client's own text stream open: queue_full) or
    whose next reply is asked only later must not grow the history past it, and a reply is
    never asked with more than the limit.
    Mutation: turns.py user_ended without its ``self._trim_history()``."""
    config = dataclasses.replace(Config(), services=ServiceSettings(max_history_messages=4))
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), config)
    events: list[dict[str, Any]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    conversation = session.conversation
    brain = RecordingBrain()
    conversation._brain = brain
    script = [(f"Question number {i}.", 0.0) for i in range(12)]
    conversation._transcriber = ScriptedSTT(*script)  # type: ignore[assignment]
    session.pipeline.start()
    drain = Drain(session.pipeline)
    try:
        for i in range(6):
            say_turn(session, 0.1)
            assert len(conversation.history) <= 4, conversation.history
            await wait_for(lambda i=i: len(brain.asked) == i + 1, timeout=3)
            await wait_for(lambda: not conversation.agent_active, timeout=3)
        # Turns that end while nothing can answer them (barge-in off, a stream held open).
        session.handle_message('{"type": "config", "barge_in": false}')
        session.handle_message('{"type": "text.delta", "delta": "Let me think"}')
        # README: "a reply still waiting to be asked keeps its question, up to 80": twice.
        for _ in range(6):
            say_turn(session, 0.1)
            assert len(conversation.history) <= 2 * 4, conversation.history
            await asyncio.sleep(0.01)
        assert all(len(asked) <= 4 for asked in brain.asked), brain.asked
    finally:
        drain.stop()
        await session.close()


async def test_a_reply_cut_by_a_barge_in_leaves_no_stream_state_behind() -> None:
    """A barge-in cancels the reply being spoken; the reply then ends its text stream
    (turns.py: "end it so the next stream starts clean"), so the pipeline forgets the
    interrupted stream. Without that, each barge-in left an entry in the pipeline's
    interrupted streams for the session's life (reply ids are never reused).
    Mutation: turns.py _run_reply's ``except CancelledError`` without ``_close_stream``."""
    brain = _SlowTalker()
    session, _, drain = talking_session(ScriptedSTT(), brain)  # type: ignore[arg-type]
    try:
        for n in range(3):
            session.conversation.ask(f"question {n}")
            await wait_for(lambda: session.pipeline.busy, timeout=3)
            session.conversation.user_started(ActivityEvent(Activity.STARTED, 0))  # barge-in
            await wait_for(lambda: not session.conversation.agent_active, timeout=3)
            session.conversation.user_speaking = False
        assert session.conversation.stats.barge_ins == 3
        assert session.pipeline._discarding == {}, session.pipeline._discarding
    finally:
        drain.stop()
        await session.close()


class _SlowTalker:
    """Writes its answer a word at a time: still writing when the user barges in."""

    name = "slow"

    async def reply(self, history: list[Message]) -> Any:
        for word in ["One. ", "Two. ", "Three. ", "Four. ", "Five. "] * 4:
            yield word
            await asyncio.sleep(0.1)


# --- the microphone's decoded frames -------------------------------------------------------------
def test_the_microphones_16_bit_audio_is_scaled_to_full_scale_floats() -> None:
    """What aiortc's Opus decoder hands the agent: packed stereo s16 at 48 kHz. The VAD and
    the turn's WAV for speech-to-text take floats in [-1, 1]: s16 samples are divided by
    32768 (unscaled, a whisper at -40 dBFS read as ~300x full scale, and every turn sent to
    STT was a clipped square wave of its sign).
    Mutation: inbound.py to_mono_float without ``/ 32768.0``."""
    import av

    from agent.inbound import to_mono_float

    mono = (np.sin(np.arange(960) * 2 * np.pi * 440 / 48_000) * 0.01 * 32767).astype(np.int16)
    stereo = np.repeat(mono, 2).reshape(1, -1)  # L R L R
    frame = av.AudioFrame.from_ndarray(stereo, format="s16", layout="stereo")
    frame.sample_rate = 48_000
    samples = to_mono_float(frame)
    assert samples.dtype == np.float32 and samples.shape == (960,)
    assert np.abs(samples).max() <= 0.011
    np.testing.assert_allclose(samples, mono / 32768.0, atol=1e-6)
    # ... and the turn's WAV keeps that level (-40 dBFS), not a clipped square wave.
    pcm = _pcm(wav_bytes(samples))
    assert np.abs(pcm).max() < 400
