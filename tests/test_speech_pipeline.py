"""The speech pipeline without a network: ordering, backpressure, failures, streams."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import pytest

from agent.breaker import CircuitBreaker
from agent.config import BreakerSettings, SpeechSettings
from agent.engine import PCM, VoiceOptions
from agent.speech import SpeechError, SpeechPipeline
from agent.text.normalize import reads_aloud
from tests.doubles import FailingEngine as ModeFailingEngine
from tests.doubles import ToneEngine, tone_frequency


class Drain:
    """Plays the buffer out as fast as it fills (as the track would, minus the clock)."""

    def __init__(self, pipeline: SpeechPipeline) -> None:
        self.pipeline = pipeline
        self.frames: list[np.ndarray] = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            frame = self.pipeline.buffer.pop()
            if frame is None:
                await asyncio.sleep(0.001)
                continue
            self.frames.append(frame.pcm)
            for mark in frame.marks:
                mark()

    def stop(self) -> None:
        self._task.cancel()


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_generation_pauses_when_far_ahead_of_playout() -> None:
    engine = ToneEngine(chunk_ms=20)
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(engine, SpeechSettings(max_buffer_ahead_s=1.0), events.append)
    pipeline.start()
    pipeline.say(" ".join(["word"] * 40))  # 10 s of audio
    await asyncio.sleep(0.3)
    # Nothing is playing: generation stops at the 1 s bound (50 frames), not 10 s.
    assert len(pipeline.buffer) == 50
    assert pipeline.buffer.buffered_seconds == 1.0
    drain = Drain(pipeline)
    await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
    drain.stop()
    assert len(drain.frames) == 500
    await pipeline.close()


async def test_event_order_and_segment_times() -> None:
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(), events.append)
    pipeline.start()
    drain = Drain(pipeline)
    pipeline.say("One two. Three four five six.", "a")
    pipeline.say("Seven.", "b")
    await wait_for(lambda: {"type": "speech.ended", "id": "b", "interrupted": False} in events)
    drain.stop()
    assert [(e["type"], e["id"]) for e in events] == [
        ("speech.started", "a"),
        ("speech.segment", "a"),
        ("speech.segment", "a"),
        ("speech.ended", "a"),
        ("speech.started", "b"),
        ("speech.segment", "b"),
        ("speech.ended", "b"),
    ]
    segments = [e for e in events if e["type"] == "speech.segment"]
    assert [s["text"] for s in segments] == ["One two.", "Three four five six.", "Seven."]
    assert [s["start_ms"] for s in segments] == [0, 500, 0]
    await pipeline.close()


def dominant_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


@pytest.mark.parametrize(
    ("engine_rate", "rate", "expected"),
    [
        (24_000, None, 24_000),  # ChatTTS: encoded as generated
        (16_000, None, 16_000),
        (22_050, None, 24_000),  # not a rate libopus takes: the next one up
        (44_100, None, 48_000),
        (24_000, 48_000, 48_000),  # --opus-input-rate 48000
    ],
)
async def test_frames_come_at_the_encoders_input_rate_with_captions_in_place(
    engine_rate: int, rate: int | None, expected: int
) -> None:
    played: list[np.ndarray] = []
    captions: list[tuple[str, int]] = []  # (text, frames played when its caption fired)

    def emit(event: dict[str, Any]) -> None:
        if event["type"] == "speech.segment":
            captions.append((event["text"], len(played)))
        events.append(event)

    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(
        ToneEngine(sample_rate=engine_rate), SpeechSettings(), emit, rate=rate
    )
    assert (pipeline.rate, pipeline.frame_samples) == (expected, expected // 50)
    pipeline.start()
    drain = Drain(pipeline)
    drain.frames = played
    pipeline.say("One two. Three four five six.", "a")  # 0.5 s, then 1 s of another tone
    await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
    drain.stop()
    assert all(f.dtype == np.int16 and f.shape == (expected // 50,) for f in played)
    assert 75 <= len(played) <= 76  # 1.5 s (and the resampler's tail, padded)
    # The second caption goes with the frame holding its first sample: frame 25 (0.5 s).
    assert captions == [("One two.", 1), ("Three four five six.", 26)]
    middle = np.concatenate(played[35:65]).astype(np.float32) / 32768
    assert abs(dominant_frequency(middle, expected) - tone_frequency("Three four five six.")) < 5
    await pipeline.close()


class FailingEngine(ToneEngine):
    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        if "boom" in text:
            yield np.zeros(2400, dtype=np.float32)
            raise RuntimeError("model exploded")
        async for chunk in super().synthesize(text, voice, continuation=continuation):
            yield chunk


async def test_engine_failure_ends_only_that_utterance() -> None:
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(FailingEngine(), SpeechSettings(), events.append)
    pipeline.start()
    drain = Drain(pipeline)
    pipeline.say("this goes boom", "bad")
    pipeline.say("this is fine", "good")
    await wait_for(
        lambda: any(e.get("id") == "good" and e["type"] == "speech.ended" for e in events)
    )
    drain.stop()
    error = next(e for e in events if e["type"] == "error")
    assert error["code"] == "tts_failed" and error["id"] == "bad" and "exploded" in error["message"]
    ended = {e["id"]: e["interrupted"] for e in events if e["type"] == "speech.ended"}
    assert ended == {"bad": True, "good": False}
    assert pipeline.stats.engine_errors == 1
    await pipeline.close()


class SilentEngine(ToneEngine):
    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        return
        yield


async def test_utterance_without_audio_still_starts_and_ends() -> None:
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(SilentEngine(), SpeechSettings(), events.append)
    pipeline.start()
    pipeline.say("hello", "quiet")
    await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
    assert [e["type"] for e in events] == ["speech.started", "speech.segment", "speech.ended"]
    await pipeline.close()


class ReadingToneEngine(ToneEngine):
    """Says what ChatTTS would read (``speakable`` as ChatTTSEngine's), as a tone."""

    def speakable(self, text: str) -> bool:
        return reads_aloud(text)


async def test_text_the_engine_would_not_read_is_refused_or_dropped_as_it_says() -> None:
    """What is spoken is the engine's to say: ChatTTS reads "℃" and "/" (a letter-or-digit
    rule would refuse them) and nothing of Cyrillic (which that rule would caption over
    silence). Through the circuit breaker, as the server wraps every engine."""
    events: list[dict[str, Any]] = []
    engine = CircuitBreaker(ReadingToneEngine(), BreakerSettings())
    pipeline = SpeechPipeline(engine, SpeechSettings(), events.append)  # type: ignore[arg-type]
    pipeline.start()
    drain = Drain(pipeline)
    with pytest.raises(SpeechError) as refused:
        pipeline.say("Привет, мир!")
    assert refused.value.code == "empty_text"
    pipeline.say("Привет! 25 ℃.", "mixed")
    await wait_for(lambda: {"type": "speech.ended", "id": "mixed", "interrupted": False} in events)
    drain.stop()
    spoken = [e["text"] for e in events if e["type"] == "speech.segment"]
    assert spoken == ["25 ℃."], spoken
    await pipeline.close()


async def test_interrupted_stream_discards_its_remaining_deltas() -> None:
    events: list[dict[str, Any]] = []
    engine = ToneEngine()
    pipeline = SpeechPipeline(engine, SpeechSettings(), events.append)
    pipeline.start()
    drain = Drain(pipeline)
    first = pipeline.text_delta("The first answer is long. It", "s1")
    await wait_for(lambda: any(e["type"] == "speech.started" for e in events))
    pipeline.interrupt()
    # The LLM keeps streaming the old answer for a moment: none of it is spoken.
    assert pipeline.text_delta("More of the old answer. ", "s1") is None
    assert pipeline.text_delta("And more. ") is None
    assert pipeline.text_end() is None
    second = pipeline.text_delta("A new answer. ", "s2")
    pipeline.text_end()
    await wait_for(lambda: {"type": "speech.ended", "id": "s2", "interrupted": False} in events)
    drain.stop()
    spoken = [e["text"] for e in events if e["type"] == "speech.segment"]
    assert spoken == ["The first answer is long.", "A new answer."]
    assert (first, second) == ("s1", "s2")
    await pipeline.close()


async def test_close_cancels_generation() -> None:
    engine = ToneEngine(chunk_delay_s=0.01)
    pipeline = SpeechPipeline(engine, SpeechSettings(), lambda e: None)
    pipeline.start()
    pipeline.say("a long text " * 20)
    await wait_for(lambda: engine.started_streams == 1)
    await pipeline.close()
    assert engine.cancelled_streams == 1
    assert len(pipeline.buffer) == 0


async def test_refused_first_delta_leaves_no_stream_behind() -> None:
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(max_text_chars=100), events.append)
    pipeline.start()
    try:
        pipeline.text_delta("x" * 101, "big")
    except SpeechError as exc:
        assert exc.code == "text_too_long"
    else:
        raise AssertionError("an over-long delta was accepted")
    assert not pipeline.busy
    assert pipeline.text_delta("Another stream. ", "other") == "other"  # no "stream_open"
    await pipeline.close()


class RecordingEngine(ToneEngine):
    def __init__(self, silent: tuple[str, ...] = ()) -> None:
        super().__init__(chunk_delay_s=0.01)
        self.voices: dict[str, VoiceOptions] = {}
        self.continuations: dict[str, bool] = {}
        self.silent = silent  # texts spoken as no audio at all

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        self.voices[text] = voice
        self.continuations[text] = continuation
        if text in self.silent:
            return
        async for chunk in super().synthesize(text, voice, continuation=continuation):
            yield chunk


async def test_a_segment_after_audible_ones_is_a_continuation_for_the_engine() -> None:
    """The engine hears which segments continue speech already playing (so it can start
    them ahead of newer streams): not an utterance's first, nor one after silent ones."""
    events: list[dict[str, Any]] = []
    engine = RecordingEngine(silent=("Hmm.",))
    pipeline = SpeechPipeline(engine, SpeechSettings(), events.append)
    pipeline.start()
    drain = Drain(pipeline)
    pipeline.say("First sentence. Second sentence.", "a")
    pipeline.say("Hmm. Fourth one.", "b")
    await wait_for(lambda: {"type": "speech.ended", "id": "b", "interrupted": False} in events)
    drain.stop()
    assert engine.continuations == {
        "First sentence.": False,
        "Second sentence.": True,
        "Hmm.": False,
        "Fourth one.": False,  # nothing of "b" was playing yet
    }
    await pipeline.close()


async def test_config_applies_to_utterances_accepted_after_it() -> None:
    events: list[dict[str, Any]] = []
    engine = RecordingEngine()
    pipeline = SpeechPipeline(engine, SpeechSettings(), events.append)
    pipeline.start()
    drain = Drain(pipeline)
    pipeline.say("First sentence. Second sentence.", "a")
    await wait_for(lambda: "First sentence." in engine.voices)
    pipeline.voice = VoiceOptions(voice="seed:7")  # what a `config` message does
    pipeline.say("Third.", "b")
    await wait_for(lambda: {"type": "speech.ended", "id": "b", "interrupted": False} in events)
    drain.stop()
    assert engine.voices["Second sentence."] == VoiceOptions()  # mid-utterance: unchanged
    assert engine.voices["Third."] == VoiceOptions(voice="seed:7")
    await pipeline.close()


class OddRateEngine(ToneEngine):
    """Its first utterance fails outside the engine's own generator (bad sample rate)."""

    calls = 0

    @property  # type: ignore[override]
    def sample_rate(self) -> int:
        OddRateEngine.calls += 1
        return 0 if OddRateEngine.calls == 1 else 24_000

    @sample_rate.setter
    def sample_rate(self, value: int) -> None:
        pass


async def test_worker_survives_a_failure_outside_the_engine() -> None:
    events: list[dict[str, Any]] = []
    # The rate given: the pipeline would otherwise read the engine's to pick one.
    pipeline = SpeechPipeline(OddRateEngine(), SpeechSettings(), events.append, rate=24_000)
    pipeline.start()
    drain = Drain(pipeline)
    pipeline.say("broken", "a")
    pipeline.say("fine", "b")
    await wait_for(lambda: {"type": "speech.ended", "id": "b", "interrupted": False} in events)
    drain.stop()
    assert {"type": "speech.ended", "id": "a", "interrupted": True} in events
    assert any(e["type"] == "error" and e.get("id") == "a" for e in events)
    await pipeline.close()


class OneBadSampleEngine(ToneEngine):
    """One second of a 300 Hz tone at half scale, in 10 chunks, with a single non-finite
    sample (a NaN from an fp16 overflow in a vocoder) in the middle."""

    def __init__(self, sample_rate: int, bad: float) -> None:
        super().__init__(sample_rate=sample_rate)
        self.bad = bad

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        t = np.arange(self.sample_rate) / self.sample_rate
        audio = (0.5 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
        audio[self.sample_rate // 2] = self.bad
        for chunk in np.array_split(audio, 10):
            yield chunk


def _longest_zero_run(samples: np.ndarray) -> int:
    best = run = 0
    for is_zero in samples == 0:
        run = run + 1 if is_zero else 0
        best = max(best, run)
    return best


async def test_one_nan_sample_from_a_resampled_engine_costs_one_sample_not_tens_of_ms() -> None:
    """A single NaN in a 22.05 kHz engine's chunk went through soxr, whose filter smeared
    it over the whole block, cast to 0: a hard dropout (37.5 ms of digital zero) in the
    middle of a word (found by review). It is one zero sample now."""
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(
        OneBadSampleEngine(22_050, float("nan")), SpeechSettings(), events.append
    )
    assert pipeline.rate == 24_000  # resampled
    pipeline.start()
    drain = Drain(pipeline)
    pipeline.say("hello world")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "invalid value encountered in cast"
        await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
    drain.stop()
    await pipeline.close()
    played = np.concatenate(drain.frames)
    # Within the tone (a 300 Hz sine at 24 kHz has at most ~1 exact-zero sample in a row):
    zeros = _longest_zero_run(played[: int(0.9 * 24_000)])
    assert zeros <= 24, f"a {zeros * 1000 / 24_000:.1f} ms hole of digital silence mid-speech"


def _captioned(
    engine: ToneEngine,
) -> tuple[SpeechPipeline, Drain, list[dict[str, Any]], list[int]]:
    """A started pipeline played out by a Drain; its events, and the frames played when each
    caption (speech.segment) was sent."""
    events: list[dict[str, Any]] = []
    caption_at: list[int] = []

    def emit(event: dict[str, Any]) -> None:
        events.append(event)
        if event["type"] == "speech.segment":
            caption_at.append(len(drain.frames))

    pipeline = SpeechPipeline(engine, SpeechSettings(), emit)
    pipeline.start()
    drain = Drain(pipeline)
    return pipeline, drain, events, caption_at


async def test_a_text_streams_sentence_plays_to_its_end_while_the_writer_pauses() -> None:
    """A text stream (LLM tokens) whose writer pauses after a sentence: its last partial
    20 ms frame (held by the Framer) and the resampler's filter tail (~33 ms at 22.05 ->
    24 kHz) were only pushed out with the *next* segment's audio (or at text.end): the
    sentence was cut short mid-waveform, then the stale tail played glued in front of the
    next sentence (found by review). ``say`` never showed it: its segments are all queued
    at once. The next sentence's caption still comes with its first frame."""
    # 2 words x 0.25 s = 0.5 s of engine audio = exactly 25 frames of 24 kHz output.
    pipeline, drain, events, caption_at = _captioned(
        ToneEngine(sample_rate=22_050, seconds_per_word=0.25)
    )
    pipeline.text_delta("Hello there. And")  # "Hello there." is a segment; "And" waits
    # The engine is instant: give it ample time to make and buffer the sentence.
    await asyncio.sleep(0.5)
    assert pipeline.buffer.producing is False  # waiting on the writer, not the engine
    heard = len(drain.frames)
    played = np.concatenate(drain.frames) if drain.frames else np.zeros(0, np.int16)
    nonzero = int(np.count_nonzero(played))
    try:
        assert heard >= 25, (
            f"only {heard} of the sentence's 25 frames were played while the writer paused "
            f"({nonzero} non-zero samples of ~12000): its tail waits for the next delta"
        )
        pipeline.text_delta(" more words.")
        pipeline.text_end()
        await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
    finally:
        drain.stop()
        await pipeline.close()
    # The second caption rides the first frame after the flushed tail: the one that plays
    # its first sample.
    assert caption_at == [1, heard + 1], (caption_at, heard)
    assert np.count_nonzero(drain.frames[heard]) > 0


async def test_caption_start_ms_stays_on_the_audio_timeline_after_writer_pauses() -> None:
    """A text stream's partial frame is padded with zeros each time its writer pauses (an
    LLM slower than the engine: after every sentence); ``start_ms`` counted in engine
    samples alone fell behind the audio by up to 20 ms a pause (found by review)."""
    # 2 words x 0.245 s = 0.49 s per sentence: 24.5 frames, so 10 ms of padding each pause.
    pipeline, drain, events, caption_frames = _captioned(
        ToneEngine(sample_rate=24_000, seconds_per_word=0.245)
    )
    try:
        for i in range(5):
            pipeline.text_delta(f"Sentence {i}. ")
            await asyncio.sleep(0.3)  # the writer (an LLM) is slower than the engine
        pipeline.text_end()
        await wait_for(lambda: any(e["type"] == "speech.ended" for e in events), timeout=20)
    finally:
        drain.stop()
        await pipeline.close()
    captions = [e for e in events if e["type"] == "speech.segment"]
    # Each caption rides the frame with its first sample (frames counted from 1 after
    # speech.started's): its start_ms should be that frame's place in the utterance.
    shifts = [
        (frame - caption_frames[0]) * 20 - c["start_ms"]
        for frame, c in zip(caption_frames, captions, strict=True)
    ]
    assert max(abs(s) for s in shifts) < 20, (
        f"caption start_ms behind the audio by {shifts} ms "
        f"(start_ms {[c['start_ms'] for c in captions]})"
    )


async def test_no_first_audio_is_observed_for_an_utterance_that_made_no_audio() -> None:
    """voice_agent_first_audio_seconds is "synthesis start to its first audio packet sent"
    (README, Metrics). An utterance the engine fails on before any audio (a crashed worker,
    or tts_unavailable while the breaker is open) sends no audio packet, yet a ~0 s sample
    was observed: during an outage the first-audio histogram reported instant speech (found
    by review)."""
    engine = ModeFailingEngine(seconds_per_word=0.05)
    engine.mode = "start"  # raises before any audio
    events: list[dict[str, Any]] = []
    observed: list[float] = []
    pipeline = SpeechPipeline(
        engine, SpeechSettings(), events.append, on_first_audio=observed.append
    )
    pipeline.start()
    drain = Drain(pipeline)
    try:
        pipeline.say("One two three.", "a")
        await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
        await asyncio.sleep(0.05)
        assert drain.frames == []  # nothing was played
        assert list(pipeline.stats.first_audio_latencies) == []  # the internal stat agrees
        assert observed == [], f"first audio observed for an utterance with no audio: {observed}"
    finally:
        drain.stop()
        await pipeline.close()


class SlowToCancelEngine(ToneEngine):
    """A tone engine whose cancelled stream takes ``cancel_s`` to finish (a model's worker
    thread answering the cancellation), and whose streams after the first start late."""

    def __init__(self, cancel_s: float, later_first_chunk_s: float) -> None:
        super().__init__(chunk_delay_s=0.01)
        self.cancel_s = cancel_s
        self.later_first_chunk_s = later_first_chunk_s

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        self.first_chunk_delay_s = self.later_first_chunk_s if self.started_streams else 0.0
        try:
            async for chunk in super().synthesize(text, voice, continuation=continuation):
                yield chunk
        except asyncio.CancelledError:
            await asyncio.sleep(self.cancel_s)
            raise


async def test_a_slow_cancellation_does_not_mark_the_next_utterance_as_making_nothing() -> None:
    """interrupt() starts a new worker at once; the old one's cancellation, finished 0.1 s
    later by the engine, set the buffer's "producing" back to False while the new worker was
    waiting for its first chunk: the new speech counted as nothing being made (not
    sounding: the session looked idle; its underruns went uncounted). Found by review."""
    engine = SlowToCancelEngine(cancel_s=0.1, later_first_chunk_s=0.6)
    pipeline = SpeechPipeline(engine, SpeechSettings(), lambda e: None)
    pipeline.start()
    pipeline.say("a long text " * 20)
    await wait_for(lambda: len(pipeline.buffer) > 0)
    pipeline.interrupt()
    pipeline.say("the next thing to say")
    await wait_for(lambda: engine.started_streams == 2)
    await asyncio.sleep(0.25)  # the old stream's cancellation has finished; no chunk yet
    assert len(pipeline.buffer) == 0
    assert pipeline.sounding, "the new utterance is being made"
    await pipeline.close()


class PacedDrain:
    """Plays the buffer out one frame per ``tick_s`` (a track, faster than real time)."""

    def __init__(self, pipeline: SpeechPipeline, tick_s: float) -> None:
        self.pipeline = pipeline
        self.tick_s = tick_s
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            frame = self.pipeline.buffer.pop()
            if frame is not None:
                for mark in frame.marks:
                    mark()

    def stop(self) -> None:
        self._task.cancel()


async def test_first_audio_excludes_time_queued_behind_the_previous_utterance() -> None:
    """README (Metrics): voice_agent_first_audio_seconds "measures the server (engine,
    framing, pacing), not time spent queued behind other speech". An engine that answers at
    once was reported as taking up to max_buffer_ahead_s (3 s) because the utterance before
    it still had that much audio buffered when this one's text reached the engine (found by
    review)."""
    observed: list[float] = []
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(
        ToneEngine(),  # its first chunk comes at once
        SpeechSettings(max_buffer_ahead_s=1.0),
        events.append,
        on_first_audio=observed.append,
    )
    pipeline.start()
    drain = PacedDrain(pipeline, tick_s=0.01)  # 50 frames (1 s of audio) take 0.5 s
    try:
        pipeline.say("one two three four five six seven eight", "a")  # 2 s of audio
        pipeline.say("one two", "b")
        await wait_for(lambda: {"type": "speech.ended", "id": "b", "interrupted": False} in events)
        assert len(observed) == 2
        # "a": the engine's first chunk went out at once. "b" as well: its wait was behind
        # "a"'s buffered second of audio, which is queueing behind other speech.
        assert observed[0] < 0.1, observed
        assert observed[1] < 0.1, f"'b' reported {observed[1]:.2f} s of first-audio latency"
    finally:
        drain.stop()
        await pipeline.close()


async def test_first_audio_excludes_the_time_playout_waited_for_a_resume() -> None:
    """README (Metrics): first audio "measures the server". A session whose client lost its
    connection pauses playout until the resume: the utterance waiting meanwhile was reported
    as seconds of first-audio latency (found by review)."""
    observed: list[float] = []
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(
        ToneEngine(), SpeechSettings(), events.append, on_first_audio=observed.append
    )
    pipeline.start()
    try:
        pipeline.say("one two", "a")  # made at once, then nothing plays it (detached)
        await asyncio.sleep(0.5)
        pipeline.playout_resumed()  # renew_track: the new connection's track plays it
        drain = PacedDrain(pipeline, tick_s=0.01)
        await wait_for(lambda: {"type": "speech.ended", "id": "a", "interrupted": False} in events)
        drain.stop()
        assert len(observed) == 1 and observed[0] < 0.1, observed
    finally:
        await pipeline.close()
