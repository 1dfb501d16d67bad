"""The voice activity model's memory across a turn the microphone's silence ended.

silero-vad is recurrent: its state carries the audio heard so far. A turn ended by the
microphone going quiet (or ending) mid-word ends without the audio saying so, and the model
must not carry that word into whatever the microphone sends next.
"""

from __future__ import annotations

import asyncio
import fractions

import av
import numpy as np
import pytest
import soxr
from aiortc.mediastreams import MediaStreamTrack

from agent.conversation_config import ListenSettings
from tests.test_conversation_units import TurnRecorder


class _MicThatPausesMidWord(MediaStreamTrack):
    """What aiortc's decoder hands the agent (48 kHz packed stereo s16, 20 ms): the start of
    a spoken sentence, then nothing at all (the client replaced its track: no RTCP BYE, the
    track stays live) until ``resume`` is set, then quiet background noise (-50 dBFS)."""

    kind = "audio"

    def __init__(self, speech: np.ndarray) -> None:
        super().__init__()
        self.speech = speech
        self.resume = asyncio.Event()
        self.sent = 0
        self._rng = np.random.default_rng(5)

    async def recv(self) -> av.AudioFrame:
        start = self.sent * 960
        if start + 960 <= self.speech.size:
            pcm = self.speech[start : start + 960]
            await asyncio.sleep(0.002)
        else:
            await self.resume.wait()
            pcm = self._rng.standard_normal(960) * 0.003
            await asyncio.sleep(0.02)
        mono = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
        stereo = np.repeat(mono, 2).reshape(1, -1)  # packed L R L R, as aiortc decodes Opus
        frame = av.AudioFrame.from_ndarray(stereo, format="s16", layout="stereo")
        frame.sample_rate = 48_000
        frame.pts = self.sent * 960
        frame.time_base = fractions.Fraction(1, 48_000)
        self.sent += 1
        return frame


@pytest.mark.timeout(60)
# 0.30, 1.06 and 1.44 s: cut points where the reader's part-window and the resampler's
# held tail still carried the cut word once the model was reset (found by review).
@pytest.mark.parametrize("cut_s", [0.4, 2.0, 0.30, 1.06, 1.44])
async def test_the_microphone_coming_back_after_a_quiet_ended_turn_is_not_a_new_onset(
    cut_s: float,
) -> None:
    """Bug: a turn the microphone's silence ended reset the SpeechDetector but not the
    session's silero-vad model, whose state was still inside the word the microphone
    stopped on. When the microphone came back (a track re-attached after switching input
    device), its first windows of mere background noise scored ~0.9-1.0 (a fresh model:
    < 0.1): with the default --min-speech-ms a new onset fired at once, a spurious
    user.speech.started and a barge-in cutting the reply the ended turn had just started.
    The reader's own buffers held the end of the word too, and fed it to the reset model."""
    from agent.inbound import InboundAudio
    from agent.vad import VadPool
    from tests.clips import SPEECH_WAV, read_wav

    samples, rate = read_wav(SPEECH_WAV)
    speech = soxr.resample(samples, rate, 48_000).astype(np.float32)
    mic = _MicThatPausesMidWord(speech[: int(cut_s * 48_000)])
    pool = VadPool()
    await pool.load()
    recorder = TurnRecorder()
    inbound = InboundAudio(mic, pool, ListenSettings(), recorder)
    inbound.start()
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 20
        while not recorder.ended and loop.time() < deadline:  # onset, then the quiet ends it
            await asyncio.sleep(0.05)
        assert len(recorder.started) == 1 and len(recorder.ended) == 1
        mic.resume.set()  # the microphone is back: background noise, nobody talking
        await asyncio.sleep(1.0)
        assert inbound.stats.windows > 25  # the noise was scored
        assert len(recorder.started) == 1, (
            f"background noise after the quiet-ended turn started {len(recorder.started) - 1}"
            " new turn(s)"
        )
    finally:
        await inbound.close()
        pool.close()


async def test_control_fresh_vad_hears_no_speech_in_that_noise() -> None:
    """The control for the test above: the same noise through a freshly started listener
    is no onset, so an onset there comes from the model's stale state alone."""
    from agent.inbound import InboundAudio
    from agent.vad import VadPool

    mic = _MicThatPausesMidWord(np.zeros(0, np.float32))
    mic.resume.set()
    pool = VadPool()
    await pool.load()
    recorder = TurnRecorder()
    inbound = InboundAudio(mic, pool, ListenSettings(), recorder)
    inbound.start()
    try:
        await asyncio.sleep(1.5)
        assert inbound.stats.windows > 25
        assert recorder.started == []
    finally:
        await inbound.close()
        pool.close()
