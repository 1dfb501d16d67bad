"""Listening: an onset is consecutive speech windows, and a turn from a DTX microphone ends
after --end-of-turn-ms of time, not of packets (found by review; each test failed before)."""

from __future__ import annotations

import asyncio
import fractions

import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamTrack

from agent.conversation_config import ListenSettings
from agent.inbound import InboundAudio
from agent.vad import SpeechDetector
from tests.test_conversation_units import TurnRecorder, run


def test_two_isolated_clicks_do_not_make_min_speech_ms_of_speech() -> None:
    """--min-speech-ms 64 (two windows): "Speech must last this long before it counts as the
    user talking (onset, barge-in): shorter blips are ignored"; SpeechDetector: "min_speech_ms
    of *consecutive* windows at or above the threshold". Two single-window clicks a second
    apart, with background (TV, music, breathing) scoring between the two thresholds in
    between, are two 32 ms blips, not 64 ms of speech. The run count is only reset by a
    window below the *silence* threshold, so the second click starts a turn (and barges in
    on the agent), and the event names window 30 (a background window) as the speech's
    first; its pre-roll holds background, not the 320 ms before the first click."""
    detector = SpeechDetector(ListenSettings(min_speech_ms=64))
    assert detector.onset_windows == 2
    background = [0.42] * 30  # ~1 s between the thresholds (0.35..0.5)
    assert run(detector, [0.9, *background, 0.9, *background]) == []


# --- a microphone that sends nothing while the user is silent (Opus DTX) -----------------


class _EnergyVad:
    """silero's stand-in: a loud window is speech, a quiet one silence."""

    async def probability(self, window: np.ndarray) -> float:
        return 0.95 if float(np.sqrt(np.mean(window**2))) > 0.05 else 0.02

    def reset(self) -> None:
        pass


class _EnergyPool:
    async def new_vad(self) -> _EnergyVad:
        return _EnergyVad()


class _DtxMic(MediaStreamTrack):
    """What aiortc hands the agent from a client whose Opus encoder runs with DTX (a
    native/GStreamer/pion client configured for it; browsers only when the answer asks
    usedtx=1, which this server's does not): 20 ms frames while the user talks, then, in
    silence, one packet every 400 ms (RTP timestamps jump 400 ms)."""

    kind = "audio"

    def __init__(self, speech_frames: int) -> None:
        super().__init__()
        self.speech_frames = speech_frames
        self.sent = 0
        self.speech_over_at: float | None = None

    async def recv(self) -> av.AudioFrame:
        loop = asyncio.get_running_loop()
        if self.sent < self.speech_frames:
            await asyncio.sleep(0.02)
            t = np.arange(960) / 48_000
            pcm = 0.3 * np.sin(2 * np.pi * 220 * t)
            pts = self.sent * 960
        else:
            if self.speech_over_at is None:
                self.speech_over_at = loop.time()
            await asyncio.sleep(0.4)
            pcm = np.zeros(960)
            pts = self.speech_frames * 960 + (self.sent - self.speech_frames + 1) * 19_200
        mono = (pcm * 32767).astype(np.int16).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(mono, format="s16", layout="mono")
        frame.sample_rate = 48_000
        frame.pts = pts
        frame.time_base = fractions.Fraction(1, 48_000)
        self.sent += 1
        return frame


@pytest.mark.timeout(30)
async def test_a_turn_ends_after_end_of_turn_ms_of_silence_from_a_dtx_microphone() -> None:
    """README: "after --end-of-turn-ms below --vad-neg-threshold, user.speech.ended" (600 ms),
    and a microphone that goes quiet "no packet for --end-of-turn-ms, at least 1 s" ends the
    turn too. A client sending with Opus DTX sends one packet per 400 ms of silence: the
    detector counts silence in *decoded windows* (19 of them, ~30 frames), never in time,
    and the quiet watchdog never fires (a packet every 0.4 s). The user's turn ends ~12 s
    after they stopped talking: no reply for 12 s, and barge-in/turn state stuck meanwhile.
    The RTP timestamps (frame.pts) say how much time passed; they are ignored."""
    mic = _DtxMic(speech_frames=50)  # 1 s of speech
    recorder = TurnRecorder()
    inbound = InboundAudio(mic, _EnergyPool(), ListenSettings(), recorder)  # type: ignore[arg-type]
    inbound.start()
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 6
        while mic.speech_over_at is None and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert recorder.started, "the speech was not heard at all"
        assert mic.speech_over_at is not None
        # 600 ms of silence ends the turn; 3 s is generous (the quiet watchdog's own bound is 1 s)
        while not recorder.ended and loop.time() < mic.speech_over_at + 3.0:
            await asyncio.sleep(0.05)
        assert recorder.ended, (
            f"3 s after the user stopped talking the turn is still open "
            f"({inbound.stats.frames - 50} DTX frames, {inbound.detector._silence} silent windows "
            f"of the {inbound.detector.silence_windows} needed)"
        )
    finally:
        await inbound.close()
