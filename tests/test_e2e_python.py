"""End to end through WebRTC with a Python aiortc client against the real server."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest

from agent.config import Config, OpusSettings
from signaling.keys import SESSIONS
from tests.conftest import LiveServer
from tests.doubles import tone_frequency
from tests.rtc_client import RtcClient


def dominant_frequency(samples: np.ndarray, rate: int = 48_000) -> float:
    window = samples * np.hanning(len(samples))
    spectrum = np.abs(np.fft.rfft(window))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def speech_span(samples: np.ndarray, threshold: float = 0.05) -> tuple[int, int]:
    loud = np.flatnonzero(np.abs(samples) > threshold)
    assert loud.size, "no audio above silence was received"
    return int(loud[0]), int(loud[-1])


async def _speak_and_record(client: RtcClient, text: str) -> tuple[np.ndarray, list[dict]]:
    start_frames = len(client.audio.frames)
    client.send({"type": "say", "text": text, "id": "u1"})
    await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=15)
    await asyncio.sleep(0.3)  # the jitter buffer still holds the tail
    return np.concatenate(client.audio.frames[start_frames:]), client.events


@pytest.mark.parametrize("whep", [False, True], ids=["offer", "whep"])
async def test_spoken_tone_arrives_intact(live_server: LiveServer, whep: bool) -> None:
    text = "one two three four five six seven eight"  # 8 words: 2 s of tone at 460 Hz
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect(whep=whep)
        try:
            await asyncio.sleep(0.3)
            if whep:
                start = len(client.audio.frames)
                async with http.post(
                    f"{live_server.url}/sessions/{client.session_id}/say", json={"text": text}
                ) as resp:
                    assert resp.status == 202
                    assert (await resp.json())["id"]
                await asyncio.sleep(2.8)
                audio = np.concatenate(client.audio.frames[start:])
            else:
                audio, events = await _speak_and_record(client, text)
                kinds = [e["type"] for e in events if e.get("id") == "u1"]
                assert kinds[0] == "speech.started"
                assert kinds[-1] == "speech.ended"
                assert "speech.segment" in kinds
                assert events[-1]["interrupted"] is False
        finally:
            await client.close()
    first, last = speech_span(audio)
    voiced = audio[first : last + 1]
    duration = len(voiced) / 48_000
    assert 1.9 < duration < 2.15, duration
    middle = voiced[len(voiced) // 4 : 3 * len(voiced) // 4]
    assert abs(dominant_frequency(middle) - tone_frequency(text)) < 5
    # Level: the engine speaks at 0.5 amplitude; Opus at 32 kbps keeps it within ~10%.
    rms = float(np.sqrt(np.mean(middle**2)))
    assert 0.5 / np.sqrt(2) * 0.85 < rms < 0.5 / np.sqrt(2) * 1.15, rms
    # No dropouts inside the utterance: every 20 ms window carries the tone.
    windows = voiced[: len(voiced) // 960 * 960].reshape(-1, 960)
    assert (np.sqrt((windows**2).mean(axis=1)) > 0.2).all()


async def test_timestamps_are_gapless_and_paced(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            client.send({"type": "say", "text": "a b c d", "id": "x"})
            await asyncio.sleep(2.0)
        finally:
            await client.close()
    pts = np.array(client.audio.pts[5:])
    assert len(pts) > 60
    assert (np.diff(pts) == 960).all(), np.unique(np.diff(pts))
    arrivals = np.array(client.audio.arrivals[5:])
    rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    assert 45 < rate < 55, rate


async def test_interrupt_silences_within_a_frame_and_drops_queue(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            client.send({"type": "say", "text": " ".join(["word"] * 40), "id": "long"})
            client.send({"type": "say", "text": "queued behind", "id": "next"})
            await client.wait_event(lambda e: e["type"] == "speech.started", timeout=10)
            await asyncio.sleep(0.5)
            interrupted_at = time.monotonic()
            client.send({"type": "interrupt"})
            await client.wait_event(lambda e: e.get("id") == "next" and e["type"] == "speech.ended")
            await asyncio.sleep(1.0)
        finally:
            await client.close()
    ended = {e["id"]: e for e in client.events if e["type"] == "speech.ended"}
    assert ended["long"]["interrupted"] is True
    assert ended["next"]["interrupted"] is True
    assert not any(e["type"] == "speech.started" and e["id"] == "next" for e in client.events)
    # Per 20 ms frame: the tone (RMS 0.35) stops for good; what still arrives after the
    # interrupt is what was already on the wire or in the client's jitter buffer (the server
    # is silent from its next tick), plus a frame or two of decoder ringing.
    rms = np.array([float(np.sqrt(np.mean(f**2))) for f in client.audio.frames])
    arrivals = np.array(client.audio.arrivals)
    loud = np.flatnonzero(rms > 0.01)
    assert loud.size and (rms[loud[-1] + 1 :] < 0.01).all()  # no sound after it stops
    late_loud = int((arrivals[loud] > interrupted_at).sum())
    assert late_loud <= 8, late_loud  # <= 160 ms of audio that had already left
    assert live_server.engine.cancelled_streams >= 1


async def test_text_deltas_are_spoken_as_one_utterance(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            for token in ["Hello", " there", ".", " How", " are", " you", "?"]:
                client.send({"type": "text.delta", "delta": token})
            client.send({"type": "text.end"})
            await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=10)
        finally:
            await client.close()
    segments = [e["text"] for e in client.events if e["type"] == "speech.segment"]
    assert segments == ["Hello there.", "How are you?"]
    ids = {e["id"] for e in client.events if e["type"].startswith("speech.")}
    assert len(ids) == 1
    starts = [e["start_ms"] for e in client.events if e["type"] == "speech.segment"]
    assert starts[0] == 0 and 450 <= starts[1] <= 560  # 2 words x 250 ms


async def test_utterances_are_spoken_in_order(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            for i in range(3):
                client.send({"type": "say", "text": f"number {i}", "id": f"n{i}"})
            await client.wait_event(lambda e: e["type"] == "speech.ended" and e["id"] == "n2")
        finally:
            await client.close()
    order = [
        (e["type"], e["id"])
        for e in client.events
        if e["type"] in ("speech.started", "speech.ended")
    ]
    assert order == [
        (kind, f"n{i}") for i in range(3) for kind in ("speech.started", "speech.ended")
    ]


async def test_speech_starts_at_full_level_after_idle(live_server: LiveServer) -> None:
    """No fade-in at onsets (DTX, if it were on by default, would cost the first ~200 ms)."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            await asyncio.sleep(1.0)  # a second of idle silence first
            audio, _ = await _speak_and_record(client, "one two three four")
        finally:
            await client.close()
    first, _ = speech_span(audio)
    onset = audio[first : first + 10 * 960].reshape(10, 960)
    rms = np.sqrt((onset**2).mean(axis=1))
    assert (rms[1:] > 0.3).all(), rms  # full level (0.35) from the second frame on


@pytest.fixture
def server_config(request: pytest.FixtureRequest) -> Config:
    threads = getattr(request, "param", 0)
    return Config(host="127.0.0.1", opus=OpusSettings(encode_threads=threads))


@pytest.mark.parametrize("server_config", [1], indirect=True, ids=["encode-ahead"])
async def test_tone_arrives_intact_when_encoded_ahead(
    live_server: LiveServer, server_config: Config
) -> None:
    assert live_server.app[SESSIONS].encode_executor is not None
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            audio, _ = await _speak_and_record(client, "one two three four five six")
        finally:
            await client.close()
    first, last = speech_span(audio)
    voiced = audio[first : last + 1]
    assert 1.4 < len(voiced) / 48_000 < 1.6
    windows = voiced[: len(voiced) // 960 * 960].reshape(-1, 960)
    assert (np.sqrt((windows**2).mean(axis=1)) > 0.2).all()


async def test_offer_listing_another_codec_first_still_gets_opus(live_server: LiveServer) -> None:
    """aiortc answers with the offer's first codec; the track only makes Opus packets."""
    from aiortc import RTCRtpReceiver

    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        capabilities = RTCRtpReceiver.getCapabilities("audio").codecs
        pcmu_first = sorted(capabilities, key=lambda c: c.name.lower() == "opus")
        assert pcmu_first[0].name.lower() != "opus"
        client.codec_preferences = pcmu_first
        await client.connect()
        try:
            answer = client.pc.remoteDescription.sdp
            audio_line = next(line for line in answer.splitlines() if line.startswith("m=audio"))
            first_pt = audio_line.split()[3]
            assert f"a=rtpmap:{first_pt} opus/48000" in answer
            audio, _ = await _speak_and_record(client, "one two three four")
        finally:
            await client.close()
    first, last = speech_span(audio)
    middle = audio[first : last + 1][9600:-9600]
    assert abs(dominant_frequency(middle) - tone_frequency("one two three four")) < 5
