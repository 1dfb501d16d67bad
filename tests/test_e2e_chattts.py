"""The product as shipped: `voice-agent serve` with ChatTTS (tiny random-weight checkpoint),
driven end to end through WebRTC by a Python client. Real ChatTTS code path, no mocks."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from tests.rtc_client import RtcClient

pytest_plugins = ["tests.conftest_chattts"]

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    def __init__(self, url: str, readiness: list[int]) -> None:
        self.url = url
        self.readiness = readiness  # /readyz status codes seen while starting


@pytest.fixture
async def served(tiny_model_dir: Path) -> AsyncIterator[Served]:
    port = free_port()
    env = {**os.environ, "VOICE_AGENT_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "signaling",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model-dir",
            str(tiny_model_dir),
            "--device",
            "cpu",
        ],
        cwd=REPO,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    seen: list[int] = []
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                assert proc.poll() is None, "server exited"
                try:
                    async with http.get(url + "/readyz") as resp:
                        seen.append(resp.status)
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            else:
                raise TimeoutError(f"server not ready: {seen[-5:]}")
        yield Served(url, seen)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


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
