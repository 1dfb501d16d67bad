"""Speech pipeline behaviour the other tests left unguarded (found by mutation testing)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent.config import SpeechSettings
from agent.speech import SpeechError, SpeechPipeline
from tests.doubles import ToneEngine
from tests.test_speech_pipeline import Drain, wait_for


def _code(exc: pytest.ExceptionInfo[SpeechError]) -> str:
    return exc.value.code


async def test_the_queue_takes_exactly_max_queued_utterances() -> None:
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(max_queued_utterances=3), events.append)
    for i in range(3):  # not started: all of them wait in the queue
        pipeline.say("Hello there.", f"u{i}")
    assert pipeline.queued == 3
    with pytest.raises(SpeechError) as refused:
        pipeline.say("One too many.", "u3")
    assert _code(refused) == "queue_full"
    assert pipeline.queued == 3
    pipeline.discard()


async def test_say_takes_exactly_max_text_chars() -> None:
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(max_text_chars=100), lambda e: None)
    pipeline.say("a" * 100)
    with pytest.raises(SpeechError) as refused:
        pipeline.say("a" * 101)
    assert _code(refused) == "text_too_long"
    pipeline.discard()


async def test_a_text_stream_is_capped_in_total_not_per_delta() -> None:
    """``max_text_chars`` bounds a whole stream: deltas that each fit must not add up to
    an unbounded text (admission control counts a stream once, relying on this cap)."""
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(max_text_chars=100), lambda e: None)
    utt = pipeline.text_delta("word " * 8)  # 40 chars
    assert pipeline.text_delta("word " * 8) == utt  # 80
    with pytest.raises(SpeechError) as refused:
        pipeline.text_delta("word " * 8)  # would be 120
    assert _code(refused) == "text_too_long"
    assert pipeline.text_delta("x" * 20) == utt  # exactly 100 still fits
    assert pipeline.text_end() == utt
    pipeline.discard()


async def test_an_interrupt_frees_a_writer_waiting_for_another_writers_stream() -> None:
    """A reply waiting in ``stream_free`` for the client's open stream must go on when an
    interrupt drops that stream, not wait for a ``text.end`` that will never matter."""
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(ToneEngine(seconds_per_word=0.05), SpeechSettings(), events.append)
    pipeline.start()
    pipeline.text_delta("The client is still typing")
    waiting = asyncio.ensure_future(pipeline.stream_free("brain"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    pipeline.interrupt()
    await asyncio.wait_for(waiting, 0.5)
    assert pipeline.opens_stream(None, "brain")
    await pipeline.close()


async def test_an_interrupt_empties_the_playout_buffer_at_once() -> None:
    """Barge-in: the very next tick after ``interrupt`` is silence, however much audio was
    buffered ahead, and the utterance ends as interrupted."""
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(max_buffer_ahead_s=1.0), events.append)
    pipeline.start()
    pipeline.say(" ".join(["word"] * 20), "long")  # 5 s of audio, nothing playing it
    await wait_for(lambda: len(pipeline.buffer) == pipeline.buffer.capacity)
    assert pipeline.interrupt() == ["long"]
    assert len(pipeline.buffer) == 0
    assert pipeline.buffer.pop() is None
    assert events[-1] == {"type": "speech.ended", "id": "long", "interrupted": True}
    await asyncio.sleep(0.05)
    assert len(pipeline.buffer) == 0  # the cancelled generation does not refill it
    await pipeline.close()


async def test_caption_times_are_in_engine_time_when_frames_are_resampled() -> None:
    """An engine at 22.05 kHz is resampled to 24 kHz frames: ``start_ms`` must still be the
    caption's place in the audio (0.5 s), not the engine's samples read at the frame rate."""
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(ToneEngine(sample_rate=22_050), SpeechSettings(), events.append)
    assert pipeline.rate == 24_000
    pipeline.start()
    drain = Drain(pipeline)
    pipeline.say("One two. Three four five six.", "a")
    await wait_for(lambda: any(e["type"] == "speech.ended" for e in events))
    drain.stop()
    segments = [e for e in events if e["type"] == "speech.segment"]
    assert [(s["text"], s["start_ms"]) for s in segments] == [
        ("One two.", 0),
        ("Three four five six.", 500),
    ]
    await pipeline.close()


async def test_a_fast_engine_yields_the_loop_between_chunks() -> None:
    """An engine that never suspends must not fill the whole buffer in one go while every
    other session's packets wait: generation gives the loop a turn per chunk."""
    pipeline = SpeechPipeline(ToneEngine(chunk_ms=20), SpeechSettings(), lambda e: None)
    pipeline.start()
    pipeline.say(" ".join(["word"] * 40))  # 10 s of audio, 3 s of buffer
    for _ in range(5):
        await asyncio.sleep(0)
    assert 0 < len(pipeline.buffer) < 20, len(pipeline.buffer)
    await pipeline.close()
