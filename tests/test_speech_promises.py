"""Promises between text and the track (README on the circuit breaker, resampling, voices and
ChatTTS worker restarts) that no other test held the code to: found by hand mutation testing
of agent/breaker.py, agent/audio.py, agent/chattts/voices.py and agent/chattts/engine.py.
Each test fails with one plausible change to them and passes on the code as it is."""

from __future__ import annotations

import asyncio
import lzma
import tracemalloc
from collections.abc import AsyncGenerator
from types import SimpleNamespace

import numpy as np
import pybase16384 as b14
import pytest

import agent.chattts.voices as voices
from agent.audio import StreamResampler
from agent.breaker import CircuitBreaker
from agent.config import BreakerSettings
from agent.engine import (
    PCM,
    EngineError,
    EngineUnavailable,
    RequestError,
    UnknownVoice,
    VoiceOptions,
)
from tests.doubles import ToneEngine

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def _speak(breaker: CircuitBreaker, text: str = "one two") -> str:
    try:
        async for _chunk in breaker.synthesize(text, VoiceOptions()):
            pass
    except EngineUnavailable:
        return "unavailable"
    except EngineError as exc:
        return f"failed {exc.incident}"
    return "ok"


class IncidentEngine(ToneEngine):
    """Each utterance fails at once with the next incident of ``incidents``."""

    def __init__(self, *incidents: str) -> None:
        super().__init__(seconds_per_word=0.02)
        self.incidents = list(incidents)

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        raise EngineError("the worker crashed", incident=self.incidents.pop(0))
        yield np.zeros(0, np.float32)  # an async generator


# --- breaker --------------------------------------------------------------------------------
async def test_errors_of_one_fault_that_go_on_past_the_window_count_again() -> None:
    """Errors sharing an incident count once only within ``window_s`` (breaker.py: "a fault
    whose errors go on is a failure again"). Without the window an incident seen once was
    never counted again: its later errors could not help open the breaker."""
    clock = Clock()
    settings = BreakerSettings(failures=2, window_s=10, cooldown_s=100)
    breaker = CircuitBreaker(IncidentEngine("crash 1", "crash 1", "crash 2"), settings, clock)
    try:
        assert await _speak(breaker) == "failed crash 1"
        clock.now += 11  # the same fault, still failing, past the window: a failure again
        assert await _speak(breaker) == "failed crash 1"
        assert breaker.state == "closed"
        clock.now += 1  # another fault 1 s later: two failures within 10 s
        assert await _speak(breaker) == "failed crash 2"
        assert breaker.state == "open"
    finally:
        await breaker.close()


async def test_a_stall_timeout_of_zero_is_no_limit() -> None:
    """README: ``--engine-stall-timeout`` ``0``: no limit. A slow engine (100 ms between
    chunks, more than any timeout the code could mistake 0 for) must speak to the end."""
    engine = ToneEngine(seconds_per_word=0.2, chunk_ms=50, chunk_delay_s=0.1)
    breaker = CircuitBreaker(engine, BreakerSettings(failures=1, stall_s=0), Clock())
    try:
        assert await _speak(breaker, "one two") == "ok"
        assert breaker.state == "closed" and engine.finished_streams == 1
    finally:
        await breaker.close()


class HangingProbeEngine(ToneEngine):
    """The first utterance fails; every later one (the probe) waits for ``release``."""

    def __init__(self) -> None:
        super().__init__(seconds_per_word=0.02)
        self.release = asyncio.Event()
        self.calls = 0

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        self.calls += 1
        if self.calls == 1:
            raise EngineError("the engine crashed")
        await self.release.wait()
        async for chunk in super().synthesize(text, voice, continuation=continuation):
            yield chunk


async def test_while_the_probe_runs_new_speech_still_fails_at_once() -> None:
    """README: once open, new speech fails at once with tts_unavailable until the probe's
    audio closes the breaker. A probe can take up to 30 s on a hung engine: during it
    (half-open) clients must not be sent to that engine, nor /readyz turn ready."""
    engine = HangingProbeEngine()
    breaker = CircuitBreaker(engine, BreakerSettings(failures=1, cooldown_s=0.05))
    try:
        assert await _speak(breaker) == "failed None"
        async with asyncio.timeout(5):
            while breaker.state != "half_open":
                await asyncio.sleep(0.005)
        assert breaker.unavailable is not None
        assert await _speak(breaker) == "unavailable"
        assert engine.calls == 2  # the failure and the probe: the client's went nowhere
        engine.release.set()
        async with asyncio.timeout(5):
            while breaker.state != "closed":
                await asyncio.sleep(0.005)
        assert breaker.unavailable is None and await _speak(breaker) == "ok"
    finally:
        engine.release.set()
        await breaker.close()


async def test_a_closed_breaker_probes_no_more() -> None:
    """``close`` (server shutdown) cancels the cool-down's timer: without it, the probe ran
    on the closed engine after close, failed, and re-armed itself every cool-down."""
    engine = HangingProbeEngine()
    engine.release.set()
    breaker = CircuitBreaker(engine, BreakerSettings(failures=1, cooldown_s=0.05))
    assert await _speak(breaker) == "failed None"
    assert breaker.state == "open"
    await breaker.close()
    await asyncio.sleep(0.3)
    assert engine.calls == 1 and breaker.state == "open"


# --- resampling -----------------------------------------------------------------------------
def test_resampling_adds_no_audible_distortion() -> None:
    """An engine at 22.05 kHz is resampled to the encoder's 24 kHz: a 9 kHz tone must come out
    a 9 kHz tone. A cheap filter (soxr "QQ") left spurious tones only 9 dB under it."""
    rin, rout, freq = 22_050, 24_000, 9_000
    t = np.arange(rin) / rin
    tone = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    resampler = StreamResampler(rin, rout)
    out = np.concatenate(
        [resampler.process(tone[i : i + 2205]) for i in range(0, rin, 2205)] + [resampler.flush()]
    )
    steady = out[rout // 10 : -rout // 10]
    power = np.abs(np.fft.rfft(steady * np.hanning(len(steady)))) ** 2
    freqs = np.fft.rfftfreq(len(steady), 1 / rout)
    wanted = power[np.abs(freqs - freq) < 50].sum()
    spurious_db = 10 * np.log10((power.sum() - wanted) / wanted)
    assert spurious_db < -80, f"spurious energy {spurious_db:.1f} dB under the tone"


# --- ChatTTS voices ------------------------------------------------------------------------
def _bank(dim: int = 16) -> voices.VoiceBank:
    chat = SimpleNamespace(config=SimpleNamespace(gpt=SimpleNamespace(hidden_size=dim)))
    return voices.VoiceBank(chat, "seed:2", 2048)


@pytest.mark.parametrize(
    "options",
    [
        VoiceOptions(speed=0),
        VoiceOptions(speed=9),
        VoiceOptions(top_p=1.0),
        VoiceOptions(top_p=0.01),
        VoiceOptions(temperature=0.01),
        VoiceOptions(temperature=2.0),
        VoiceOptions(top_k=1),
        VoiceOptions(top_k=100),
    ],
)
def test_every_option_in_the_readmes_ranges_is_spoken(options: VoiceOptions) -> None:
    """README (config): ``speed`` 0-9, ``temperature`` 0.01-2.0, ``top_p`` 0.01-1.0,
    ``top_k`` 1-100. The protocol lets these through; the engine must not refuse them."""
    _bank().check(options)
    prompt, _sampling = _bank()._options(options)
    assert prompt == f"[speed_{5 if options.speed is None else options.speed}]"


@pytest.mark.parametrize(
    "options",
    [
        VoiceOptions(speed=-1),
        VoiceOptions(speed=10),
        VoiceOptions(temperature=0.0),
        VoiceOptions(top_p=0.0),
        VoiceOptions(top_p=1.01),
        VoiceOptions(top_k=0),
    ],
)
def test_options_the_model_cannot_sample_with_are_the_clients_error(
    options: VoiceOptions,
) -> None:
    """Temperature 0 divides the logits by zero, top_k 0 keeps no token: a RequestError
    (the client's ``bad_config``), checked on the event loop, not a worker's failure."""
    with pytest.raises(RequestError):
        _bank().check(options)


def test_a_malformed_tail_marker_never_reaches_the_c_decoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pybase16384's C decoder trusts a tail marker U+3D00+n as a byte count (U+3D7F: 127
    bytes written into a buffer sized for the text); only U+3D00-U+3D06 is what it writes.
    Well-formed characters before such a marker must not let it through (the existing test
    sends the marker alone, which the "+" of the pattern already refuses)."""
    reached: list[str] = []
    decode = b14.decode_from_string

    def recording_decode(text: str) -> bytes:
        reached.append(text)
        return decode(text) if text[-1] <= "\u3d06" else b""  # never the C code on those

    monkeypatch.setattr(b14, "decode_from_string", recording_decode)
    for bad in ("\u4e00\u3d7f", "\u4e00\u4e01\u3d07", "\u4e00\u3dff"):
        with pytest.raises(UnknownVoice):
            voices.decode_speaker(bad, 16)
    assert reached == []
    with pytest.raises(UnknownVoice):  # a well-formed string does reach it (control)
        voices.decode_speaker("\u4e00\u4e01\u3d01", 16)
    assert reached == ["\u4e00\u4e01\u3d01"]


def test_a_compressed_voice_bomb_is_not_expanded() -> None:
    """A speaker string is LZMA-compressed: a few kB of it (a config message) can hold tens
    of MB. ``decode_speaker`` decompresses only what ``dim`` values need; expanded whole, one
    message cost the event loop the time and memory of the whole bomb."""

    def peak_decoding(megabytes: float) -> int:
        raw = bytes(int(megabytes * 1024 * 1024))
        packed = lzma.compress(raw, format=lzma.FORMAT_RAW, filters=voices.SPEAKER_FILTERS)
        voice = b14.encode_to_string(packed)
        assert len(voice) < 4096  # fits a config message's voice
        tracemalloc.start()
        try:
            with pytest.raises(UnknownVoice):
                voices.decode_speaker(voice, 768)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # The decoder's own dictionary (64 MiB at preset 9) is paid by any speaker string; the
    # bomb must cost nothing beyond it.
    small, bomb = peak_decoding(0.01), peak_decoding(32)
    assert bomb - small < 4 * 1024 * 1024, f"{(bomb - small) / 2**20:.0f} MiB more for a bomb"


@pytest.mark.parametrize("kind", ["random", "repetitive"])
def test_a_speaker_string_decodes_exactly_in_little_memory(kind: str) -> None:
    """Decoding a speaker string allocated the encoder's LZMA dictionary (64 MiB at preset
    9) for every config message that names a voice. The window only has to span what is
    decoded: the same values come back, in well under a MiB."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal(768).astype(np.float16)
    if kind == "repetitive":  # long matches reaching back over most of the output
        values = np.tile(values[:24], 32)
    packed = lzma.compress(values.tobytes(), format=lzma.FORMAT_RAW, filters=voices.SPEAKER_FILTERS)
    voice = b14.encode_to_string(packed)
    tracemalloc.start()
    try:
        decoded = voices.decode_speaker(voice, 768)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert decoded.tobytes() == values.tobytes()
    assert peak < 1024 * 1024, f"{peak / 2**20:.1f} MiB to decode one speaker string"


# --- ChatTTS engine: worker restarts --------------------------------------------------------
async def test_worker_crashes_far_apart_are_each_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    """README: more than 3 deaths *within 5 minutes* leave the engine failed. Crashes an
    hour apart (a rare CUDA out-of-memory) are each restarted: crashes older than the window
    are forgotten, or the fourth in the process's life would leave it failed for good."""
    import agent.chattts.engine as engine_module
    from agent.config import ChatTTSSettings

    now = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    engine = engine_module.ChatTTSEngine(ChatTTSSettings())
    engine._loop = asyncio.get_running_loop()
    engine._ready = True  # started: crashes are restarted (no model needed to plan one)
    scheduler = SimpleNamespace(alive=False, crash_incident="crash")
    engine.scheduler = scheduler  # type: ignore[assignment]
    try:
        for crash in range(engine_module.MAX_RESTARTS + 3):
            now[0] = crash * 3600.0
            engine._plan_restart()
            assert engine._restart is not None, f"crash {crash + 1}, an hour after the last"
            assert scheduler.crash_incident == "crash"
            engine._restart.cancel()
            engine._restart, engine._restarted = None, None
        for _ in range(engine_module.MAX_RESTARTS + 1):  # and still: 4 within 5 min are not
            now[0] += 1.0
            engine._plan_restart()
            if engine._restart is not None:
                engine._restart.cancel()
                engine._restart, engine._restarted = None, None
        assert scheduler.crash_incident is None  # left failed
    finally:
        engine.scheduler = None
