"""Test-only engines. Never imported by the product."""

from __future__ import annotations

import asyncio
import fractions
import functools
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import av
import numpy as np
import numpy.typing as npt
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtcpSenderInfo, RtcpSrPacket

from agent.engine import PCM, EngineError, UnknownVoice, VoiceOptions


def tone_frequency(text: str) -> float:
    """A frequency the test can predict from the text: 300 Hz + 20 Hz per word (capped)."""
    return 300.0 + 20.0 * min(len(text.split()), 30)


@functools.lru_cache(maxsize=64)
def _tone_table(
    freq: float, sample_rate: int, chunk: int, amplitude: float
) -> npt.NDArray[np.float32] | None:
    """One second of the tone (plus a chunk, so no chunk wraps), or None when a whole-Hz
    tone does not repeat every second. Computing ``sin`` per chunk was ~6% of the streams
    bench's server time at N=100; a real engine's synthesis runs off the event loop."""
    if not float(freq).is_integer():
        return None
    t = np.arange(sample_rate + chunk, dtype=np.float64) / sample_rate
    table = (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    table.flags.writeable = False
    return table


class ToneEngine:
    """Speaks every text as a sine tone: ``seconds_per_word`` of audio per word.

    Chunks of ``chunk_ms`` are yielded, each after ``chunk_delay_s`` (0 = as fast as the
    consumer takes them), at ``sample_rate`` (24 kHz like ChatTTS, so resampling is tested).
    """

    name = "tone"

    def __init__(
        self,
        sample_rate: int = 24_000,
        seconds_per_word: float = 0.25,
        chunk_ms: int = 100,
        chunk_delay_s: float = 0.0,
        amplitude: float = 0.5,
        first_chunk_delay_s: float = 0.0,
    ) -> None:
        self.sample_rate = sample_rate
        self.seconds_per_word = seconds_per_word
        self.chunk_ms = chunk_ms
        self.chunk_delay_s = chunk_delay_s
        self.first_chunk_delay_s = first_chunk_delay_s
        self.amplitude = amplitude
        self._ready = False
        self.started_streams = 0
        self.finished_streams = 0
        self.cancelled_streams = 0

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def failure(self) -> str | None:
        return None

    async def start(self) -> None:
        self._ready = True

    async def close(self) -> None:
        self._ready = False

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        self.started_streams += 1
        words = max(1, len(text.split()))
        total = int(words * self.seconds_per_word * self.sample_rate)
        freq = tone_frequency(text)
        chunk = max(1, self.sample_rate * self.chunk_ms // 1000)
        done = 0
        try:
            if self.first_chunk_delay_s:
                await asyncio.sleep(self.first_chunk_delay_s)
            table = _tone_table(freq, self.sample_rate, chunk, self.amplitude)
            while done < total:
                n = min(chunk, total - done)
                if table is None:
                    t = (np.arange(done, done + n, dtype=np.float64)) / self.sample_rate
                    yield (self.amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)
                else:
                    start = done % self.sample_rate
                    yield table[start : start + n].copy()
                done += n
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            self.finished_streams += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled_streams += 1
            raise


class ClipEngine(ToneEngine):
    """Speaks every text as a fixed clip of mono PCM (e.g. recorded speech), looped to
    ``seconds_per_word`` per word, in ``chunk_ms`` chunks at the clip's rate."""

    name = "clip"

    def __init__(self, clip: np.ndarray, sample_rate: int, **kwargs: float) -> None:
        super().__init__(sample_rate=sample_rate, **kwargs)  # type: ignore[arg-type]
        if clip.ndim != 1 or not clip.size:
            raise ValueError("the clip must be non-empty mono PCM")
        self.clip = clip.astype(np.float32)

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        self.started_streams += 1
        total = int(max(1, len(text.split())) * self.seconds_per_word * self.sample_rate)
        chunk = max(1, self.sample_rate * self.chunk_ms // 1000)
        done = 0
        try:
            while done < total:
                n = min(chunk, total - done)
                index = np.arange(done, done + n) % self.clip.size
                yield self.clip[index]
                done += n
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            self.finished_streams += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled_streams += 1
            raise


class FailingEngine(ToneEngine):
    """A ToneEngine that fails when told: ``mode`` is ``"ok"``, ``"start"`` (raises before
    any audio), ``"midway"`` (raises after ``good_chunks`` chunks of audio), ``"hang"``
    (after ``good_chunks`` chunks, waits for ever: a wedged engine; ``hung`` counts those
    cancelled) or ``"refuse"`` (refuses every voice, as an engine that finds out only when it
    speaks). Like ChatTTS, its
    ``check_voice`` refuses voices other than ``seed:N`` when a client sets them."""

    name = "failing"

    def __init__(self, **kwargs: float) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.mode = "ok"
        self.good_chunks = 3
        self.failures = 0
        self.hung = 0

    def check_voice(self, voice: VoiceOptions) -> None:
        if voice.voice is not None and not voice.voice.startswith("seed:"):
            raise UnknownVoice(f"unknown voice {voice.voice[:40]!r}")

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        self.check_voice(voice)
        if self.mode == "refuse":
            raise UnknownVoice(f"unknown voice {voice.voice!r}: no speaker for it")
        if self.mode == "start":
            self.failures += 1
            raise EngineError("the engine's worker crashed")
        n = 0
        async with aclosing(super().synthesize(text, voice, continuation=continuation)) as chunks:
            async for chunk in chunks:
                if self.mode == "midway" and n == self.good_chunks:
                    self.failures += 1
                    raise EngineError("the engine failed mid-utterance")
                if self.mode == "hang" and n == self.good_chunks:
                    try:
                        await asyncio.Event().wait()
                    finally:
                        self.hung += 1
                n += 1
                yield chunk


class ToneMicrophone(MediaStreamTrack):
    """A microphone for room tests: a steady sine tone, 20 ms AudioFrames paced in real time."""

    kind = "audio"

    def __init__(self, frequency: float, amplitude: float = 0.3, rate: int = 48_000) -> None:
        super().__init__()
        self.frequency = frequency
        self.amplitude = amplitude
        self.rate = rate
        self._samples = rate // 50
        self._sent = 0
        self._start: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._sent / self.rate - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        t = np.arange(self._sent, self._sent + self._samples) / self.rate
        pcm = (self.amplitude * 32767 * np.sin(2 * np.pi * self.frequency * t)).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self._sent
        frame.time_base = fractions.Fraction(1, self.rate)
        self._sent += self._samples
        return frame


class RtcpSender:
    """Stands in for aiortc's ``RTCRtpSender`` where agent/feedback.py hooks it: its SSRC,
    the RTCP it receives, and the sender reports it sends (as aiortc 1.16's ``_run_rtcp``)."""

    def __init__(self, ssrc: int = 0x1234) -> None:
        self._ssrc = ssrc
        self.sent: list[object] = []

    async def _handle_rtcp_packet(self, packet: object) -> None:
        return None

    async def _send_rtcp(self, packets: list[object]) -> None:
        self.sent.extend(packets)

    async def send_sr(self, ntp_timestamp: int) -> int:
        """A sender report stamped ``ntp_timestamp``, noted as aiortc notes it (its own
        exact time for this latest LSR) and sent; returns the LSR a receiver will echo."""
        lsr = (ntp_timestamp >> 16) & 0xFFFFFFFF
        self._RTCRtpSender__lsr = lsr
        self._RTCRtpSender__lsr_time = time.time()
        info = RtcpSenderInfo(
            ntp_timestamp=ntp_timestamp, rtp_timestamp=0, packet_count=0, octet_count=0
        )
        await self._send_rtcp([RtcpSrPacket(ssrc=self._ssrc, sender_info=info)])
        return lsr
