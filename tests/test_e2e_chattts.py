"""The product as shipped: `voice-agent serve` with ChatTTS (tiny random-weight checkpoint),
driven end to end through WebRTC by a Python client. Real ChatTTS code path, no mocks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from tests.rtc_client import RtcClient
from tests.served import Served, serve_subprocess

pytest_plugins = ["tests.conftest_chattts"]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    # The product's defaults: as many media workers as cores, behind one front process.
    with serve_subprocess(tiny_model_dir) as server:
        yield server


async def test_chattts_speech_reaches_a_webrtc_client(served: Served) -> None:
    assert served.readiness[-1] == 200
    assert set(served.readiness) <= {200, 503}
    async with aiohttp.ClientSession() as http:
        async with http.get(served.url + "/readyz") as resp:
            assert (await resp.json())["engine"] == "chattts"
        client = RtcClient(served.url, http)
        await client.connect()
        try:
            await asyncio.sleep(0.3)
            start = len(client.audio.frames)
            client.send({"type": "say", "text": "Hello there. It costs $5 today!", "id": "c1"})
            await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=60)
            await asyncio.sleep(0.3)
            audio = np.concatenate(client.audio.frames[start:])
        finally:
            await client.close()
    kinds = [e["type"] for e in client.events if e.get("id") == "c1"]
    assert kinds == ["speech.started", "speech.segment", "speech.segment", "speech.ended"]
    ended = client.events[-1]
    assert ended["interrupted"] is False
    segments = [e["text"] for e in client.events if e["type"] == "speech.segment"]
    assert segments == ["Hello there.", "It costs $5 today!"]
    # A random-weight model babbles, but it babbles for about as long as the text: the
    # received audio carries energy for a stretch of the right order (0.3-0.5 s per word).
    frame_rms = np.sqrt((audio[: len(audio) // 960 * 960].reshape(-1, 960) ** 2).mean(axis=1))
    voiced_s = float((frame_rms > 1e-3).sum()) * 0.02
    assert 0.8 < voiced_s < 8.0, voiced_s


async def test_interrupting_one_session_leaves_another_speaking(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        a, b = RtcClient(served.url, http), RtcClient(served.url, http)
        await asyncio.gather(a.connect(), b.connect())
        try:
            text = "one two three four five six seven eight nine ten"
            a.send({"type": "say", "text": text, "id": "a"})
            b.send({"type": "say", "text": text, "id": "b"})
            await a.wait_event(lambda e: e["type"] == "speech.started", timeout=60)
            a.send({"type": "interrupt"})
            ended_a = await a.wait_event(lambda e: e["type"] == "speech.ended", timeout=10)
            ended_b = await b.wait_event(lambda e: e["type"] == "speech.ended", timeout=90)
        finally:
            await asyncio.gather(a.close(), b.close())
    assert ended_a["interrupted"] is True
    assert ended_b["interrupted"] is False
    assert not any(e["type"] == "error" for e in a.events + b.events)
