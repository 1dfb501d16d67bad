"""End to end through WebRTC with a microphone: barge-in, full turns, history.

The Python client sends recorded speech (tests/data/speech.wav, made with espeak-ng) on its
microphone track; the real server runs silero-vad on it; the STT and LLM services are real
HTTP servers (tests/services.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from agent.config import Config
from agent.conversation_config import ListenSettings, ServiceSettings
from agent.opus import OpusDecoder
from tests.clips import SPEECH_WAV, noise_and_music, read_wav, speech_onset
from tests.conftest import LiveServer, serve
from tests.doubles import ToneEngine
from tests.mic import ClipMic
from tests.rtc_client import RtcClient
from tests.services import FakeLLM, FakeSTT

pytestmark = pytest.mark.timeout(120)

SILENT_RMS = 0.01


@dataclasses.dataclass
class Packets:
    """Every RTP packet the client received: arrival time and payload, in arrival order."""

    arrivals: list[float] = dataclasses.field(default_factory=list)
    payloads: list[bytes] = dataclasses.field(default_factory=list)

    def tap(self, _seq: int, payload: bytes) -> None:
        self.arrivals.append(time.monotonic())
        self.payloads.append(payload)

    def last_loud_arrival(self) -> float:
        decoder = OpusDecoder()
        last = None
        for at, payload in zip(self.arrivals, self.payloads, strict=True):
            pcm = decoder.decode(payload).astype(np.float32) / 32768
            if float(np.sqrt(np.mean(pcm**2))) > SILENT_RMS:
                last = at
        assert last is not None, "no loud packet received"
        return last


async def connect_with_mic(server: LiveServer, http: aiohttp.ClientSession) -> RtcClient:
    client = RtcClient(server.url, http)
    client.mic = ClipMic()
    packets = Packets()
    client.rtp_tap = packets.tap
    client.packets = packets  # type: ignore[attr-defined]
    await client.connect()
    deadline = time.monotonic() + 30  # the first session loads torch + silero (seconds)
    while True:
        async with http.get(f"{server.url}/sessions/{client.session_id}") as resp:
            stats = await resp.json()
        if stats["inbound"] and stats["inbound"]["ready"] and stats["inbound"]["windows"] > 5:
            return client
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.1)


def speech_clip() -> tuple[np.ndarray, int, float]:
    samples, rate = read_wav(SPEECH_WAV)
    return samples, rate, speech_onset(samples, rate)


def of_type(client: RtcClient, kind: str) -> list[dict[str, Any]]:
    return [e for e in client.events if e["type"] == kind]


@pytest.fixture
def services() -> tuple[FakeSTT, FakeLLM]:
    return FakeSTT(), FakeLLM()


@pytest.fixture
async def talk_server(
    services: tuple[FakeSTT, FakeLLM], request: pytest.FixtureRequest
) -> AsyncIterator[LiveServer]:
    stt, llm = services
    use_llm = getattr(request, "param", True)
    async with stt, llm:
        config = Config(
            host="127.0.0.1",
            listen=ListenSettings(end_of_turn_silence_ms=500),
            services=ServiceSettings(
                stt_base_url=stt.url,
                stt_api_key="stt-secret-key",
                llm_base_url=llm.url if use_llm else None,
                llm_api_key="llm-secret-key",
                llm_model="test-model",
                system_prompt="Be brief.",
                llm_timeout_s=2.0,
                stt_timeout_s=2.0,
            ),
        )
        async with serve(config, ToneEngine()) as server:
            yield server


@pytest.mark.serial  # barge-in latency under 400 ms: measured alone
async def test_speech_barges_in_while_agent_speaks(talk_server: LiveServer) -> None:
    samples, rate, onset = speech_clip()
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(talk_server, http)
        try:
            client.send({"type": "say", "text": " ".join(["word"] * 40), "id": "long"})
            await client.wait_event(lambda e: e["type"] == "speech.started", timeout=10)
            await asyncio.sleep(0.6)
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            await client.wait_event(lambda e: e["type"] == "user.speech.started", timeout=5)
            ended = await client.wait_event(
                lambda e: e["type"] == "speech.ended" and e["id"] == "long", timeout=5
            )
            assert ended["interrupted"] is True
            await asyncio.sleep(0.5)  # anything still in flight has arrived
            onset_sent = client.mic.sent_at(onset)  # type: ignore[union-attr]
            last_loud = client.packets.last_loud_arrival()  # type: ignore[attr-defined]
        finally:
            await client.close()
    latency_ms = (last_loud - onset_sent) * 1000
    print(f"\nbarge-in: speech onset sent -> last loud agent packet {latency_ms:.0f} ms")
    # The product target (p95 <= 150 ms) is measured by bench/bargein.py on a quiet
    # machine; here the bound only catches a barge-in that did not cut the audio at once.
    assert 0 < latency_ms < 400, latency_ms
    kinds = [e["type"] for e in client.events]
    assert kinds.index("user.speech.started") > kinds.index("speech.started")
    assert talk_server.engine.cancelled_streams >= 1


async def test_barge_in_can_be_turned_off_per_session(talk_server: LiveServer) -> None:
    samples, rate, _ = speech_clip()
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(talk_server, http)
        try:
            client.send({"type": "config", "barge_in": False})
            client.send({"type": "say", "text": " ".join(["word"] * 16), "id": "long"})
            await client.wait_event(lambda e: e["type"] == "speech.started", timeout=10)
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            await client.wait_event(lambda e: e["type"] == "user.speech.started", timeout=5)
            ended = await client.wait_event(
                lambda e: e["type"] == "speech.ended" and e["id"] == "long", timeout=10
            )
            assert ended["interrupted"] is False
            # The turn was still heard, and answered after the agent finished.
            await client.wait_event(lambda e: e["type"] == "user.transcript", timeout=10)
        finally:
            await client.close()


async def test_full_turn_speech_to_spoken_llm_reply(
    talk_server: LiveServer, services: tuple[FakeSTT, FakeLLM]
) -> None:
    stt, llm = services
    stt.transcripts.append("what time is it")
    llm.replies.append(["It is", " noon", ".", " Anything", " else", "?"])
    llm.token_delay_s = 0.15
    samples, rate, _ = speech_clip()
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(talk_server, http)
        try:
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            started = await client.wait_event(lambda e: e["type"] == "user.speech.started")
            user_ended = await client.wait_event(lambda e: e["type"] == "user.speech.ended")
            transcript = await client.wait_event(lambda e: e["type"] == "user.transcript")
            await client.wait_event(lambda e: e["type"] == "speech.started", timeout=5)
            # The first sentence is heard while the LLM is still writing the second.
            assert llm.finished == 0
            reply_ended = await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=15)
        finally:
            await client.close()
    assert started["id"] == user_ended["id"] == transcript["id"]
    assert transcript["text"] == "what time is it"
    # The upload: a 16 kHz WAV holding the whole utterance (plus pre-roll, minus the tail).
    upload = stt.uploads[0]
    clip_s = samples.size / rate
    assert clip_s - 0.5 < upload.duration_s() < clip_s + 1.0, upload.duration_s()
    assert upload.fields["model"] == "whisper-1"
    assert upload.authorization == "Bearer stt-secret-key"
    assert abs(user_ended["duration_ms"] / 1000 - upload.duration_s()) < 0.05
    # The LLM request: system prompt, then the transcript; streamed.
    request = llm.requests[0]
    assert request["model"] == "test-model" and request["stream"] is True
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "what time is it"},
    ]
    assert llm.authorizations[0] == "Bearer llm-secret-key"
    # The reply is spoken sentence by sentence; the first sentence before the LLM finished.
    reply_id = reply_ended["id"]
    assert reply_ended["interrupted"] is False
    segments = [e for e in of_type(client, "speech.segment") if e["id"] == reply_id]
    assert [s["text"] for s in segments] == ["It is noon.", "Anything else?"]
    kinds = [(e["type"], e.get("id")) for e in client.events]
    assert kinds.index(("user.transcript", transcript["id"])) < kinds.index(
        ("speech.started", reply_id)
    )


@pytest.mark.parametrize("talk_server", [False], indirect=True, ids=["echo"])
async def test_full_turn_with_the_echo_brain(
    talk_server: LiveServer, services: tuple[FakeSTT, FakeLLM]
) -> None:
    stt, llm = services
    stt.transcripts.append("Hello there.")
    samples, rate, _ = speech_clip()
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(talk_server, http)
        try:
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            await client.wait_event(lambda e: e["type"] == "user.transcript")
            ended = await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=10)
        finally:
            await client.close()
    segments = [e["text"] for e in of_type(client, "speech.segment") if e["id"] == ended["id"]]
    assert segments == ["Hello there."]
    assert not llm.requests


async def test_history_holds_only_what_was_played(
    talk_server: LiveServer, services: tuple[FakeSTT, FakeLLM]
) -> None:
    """An interrupted reply goes into the next request cut at the last segment played."""
    stt, llm = services
    first_sentences = [f" Sentence number {w} is here." for w in ("one", "two", "three", "four")]
    llm.replies.append(["Sure."] + first_sentences * 3)
    llm.replies.append(["Okay."])
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(talk_server, http)
        try:
            client.send({"type": "chat", "text": "tell me a long story"})
            # Let two or three sentences play, then talk over the agent.
            await client.wait_event(
                lambda e: len(of_type(client, "speech.segment")) >= 3, timeout=10
            )
            samples, rate, _ = speech_clip()
            stt.transcripts.append("stop please")
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            interrupted = await client.wait_event(
                lambda e: e["type"] == "speech.ended" and e["interrupted"], timeout=5
            )
            played = [
                e["text"] for e in of_type(client, "speech.segment") if e["id"] == interrupted["id"]
            ]
            await client.wait_event(lambda e: e["type"] == "user.transcript", timeout=10)
            await client.wait_event(
                lambda e: e["type"] == "speech.ended" and not e["interrupted"], timeout=10
            )
        finally:
            await client.close()
    assert len(llm.requests) == 2
    messages = llm.requests[1]["messages"]
    assert messages[0]["role"] == "system"
    assert messages[1] == {"role": "user", "content": "tell me a long story"}
    assert messages[2] == {"role": "assistant", "content": " ".join(played)}
    assert messages[3] == {"role": "user", "content": "stop please"}
    assert 3 <= len(played) < 13, played  # cut: the reply had 13 sentences


async def test_service_failures_become_error_events(
    talk_server: LiveServer, services: tuple[FakeSTT, FakeLLM]
) -> None:
    stt, llm = services
    samples, rate, _ = speech_clip()
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(talk_server, http)
        try:
            stt.status = 503
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            error = await client.wait_event(lambda e: e["type"] == "error", timeout=10)
            assert error["code"] == "stt_failed" and "model overloaded" in error["message"]
            assert error["id"].startswith("turn-")
            # The LLM fails: an error for the reply, no speech.
            llm.status = 500
            client.send({"type": "chat", "text": "hello"})
            error = await client.wait_event(
                lambda e: e["type"] == "error" and e["code"] == "llm_failed", timeout=5
            )
            assert "rate limit reached" in error["message"]
            # The LLM stalls: a timeout (2 s here).
            llm.status = 200
            llm.first_token_delay_s = 5
            client.send({"type": "chat", "text": "hello again"})
            error = await client.wait_event(
                lambda e: e["type"] == "error" and e["code"] == "llm_timeout", timeout=5
            )
            # The session goes on: a good turn is spoken.
            llm.first_token_delay_s = 0
            client.send({"type": "chat", "text": "and now?"})
            ended = await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=10)
            assert ended["interrupted"] is False
        finally:
            await client.close()
    spoken = [e["id"] for e in client.events if e["type"] == "speech.started"]
    assert spoken == [ended["id"]], spoken  # the failed replies said nothing
    # The history kept the users' questions but no reply nobody heard (sent as one user
    # message: roles alternate on the wire).
    assert llm.requests[-1]["messages"][1:] == [
        {"role": "user", "content": "hello\nhello again\nand now?"},
    ]


async def test_no_speech_to_text_configured_says_so(live_server: LiveServer) -> None:
    samples, rate, _ = speech_clip()
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(live_server, http)
        try:
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            ended = await client.wait_event(lambda e: e["type"] == "user.speech.ended")
            error = await client.wait_event(lambda e: e["type"] == "error")
            # A second turn: not transcribed either, and not reported again.
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            second = await client.wait_event(
                lambda e: e["type"] == "user.speech.ended" and e["id"] != ended["id"], 15
            )
            await asyncio.sleep(0.5)
        finally:
            await client.close()
    assert error["code"] == "stt_unavailable" and error["id"] == ended["id"]
    assert second["id"] != ended["id"]
    assert [e["code"] for e in client.events if e["type"] == "error"] == ["stt_unavailable"]


async def test_captions_arrive_with_the_first_packet_of_their_audio(
    live_server: LiveServer,
) -> None:
    """Each speech.segment reaches the client within 60 ms of its audio's first packet."""
    text = "One two three. Four five six seven. Eight nine. Ten eleven twelve thirteen."
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        packets = Packets()
        client.rtp_tap = packets.tap
        await client.connect()
        try:
            await asyncio.sleep(0.5)
            client.send({"type": "say", "text": text, "id": "cap"})
            await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=15)
            await asyncio.sleep(0.3)
        finally:
            await client.close()
    decoder = OpusDecoder()
    loud = [
        float(np.sqrt(np.mean((decoder.decode(p).astype(np.float32) / 32768) ** 2))) > SILENT_RMS
        for p in packets.payloads
    ]
    first = loud.index(True)  # the utterance's first packet (silence before it)
    segments = [
        (e, at)
        for e, at in zip(client.events, client.event_times, strict=True)
        if e["type"] == "speech.segment"
    ]
    assert [e["text"] for e, _ in segments] == [
        "One two three.",
        "Four five six seven.",
        "Eight nine.",
        "Ten eleven twelve thirteen.",
    ]
    offsets = []
    for event, arrived in segments:
        packet = first + event["start_ms"] // 20  # the frame holding its first sample
        assert loud[packet], event  # the segment's audio starts there
        offsets.append((arrived - packets.arrivals[packet]) * 1000)
    print(f"\ncaption arrival - first packet of its audio: {[round(o) for o in offsets]} ms")
    assert all(abs(o) <= 60 for o in offsets), offsets


async def test_interrupt_message_also_stops_the_llm(
    talk_server: LiveServer, services: tuple[FakeSTT, FakeLLM]
) -> None:
    _, llm = services
    llm.replies.append(["First sentence here."] + [" More words."] * 30)
    llm.replies.append(["Fine."])
    llm.token_delay_s = 0.2
    async with aiohttp.ClientSession() as http:
        client = RtcClient(talk_server.url, http)
        await client.connect()
        try:
            client.send({"type": "chat", "text": "talk a lot"})
            await client.wait_event(lambda e: e["type"] == "speech.started", timeout=10)
            client.send({"type": "interrupt"})
            first = await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=5)
            assert first["interrupted"] is True
            # The HTTP stream was closed, not left open (or read on) to its end, 6 s away:
            # the fake server's next write, 0.2 s later at most, finds it gone. (Checking
            # `finished` alone passed whether or not it was closed: found by review.)
            deadline = time.monotonic() + 3
            while llm.abandoned == 0:
                assert time.monotonic() < deadline, "the LLM's stream was not closed"
                await asyncio.sleep(0.05)
            assert llm.finished == 0
            client.send({"type": "chat", "text": "and now?"})
            second = await client.wait_event(
                lambda e: e["type"] == "speech.ended" and e["id"] != first["id"], timeout=10
            )
        finally:
            await client.close()
    assert second["interrupted"] is False
    assert llm.requests[1]["messages"][2] == {
        "role": "assistant",
        "content": "First sentence here.",
    }


async def test_microphone_ignored_when_listening_is_off() -> None:
    config = Config(host="127.0.0.1", listen=ListenSettings(enabled=False))
    samples, rate, _ = speech_clip()
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        client = RtcClient(server.url, http)
        client.mic = ClipMic()
        await client.connect()
        try:
            client.mic.play(samples, rate)
            await asyncio.wait_for(client.mic.done.wait(), 10)
            await asyncio.sleep(0.8)
            async with http.get(f"{server.url}/sessions/{client.session_id}") as resp:
                stats = await resp.json()
        finally:
            await client.close()
    assert stats["inbound"] is None
    assert not [e for e in client.events if e["type"].startswith("user.")]


async def test_music_and_noise_do_not_barge_in(talk_server: LiveServer) -> None:
    music = noise_and_music(6.0)
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(talk_server, http)
        try:
            client.send({"type": "say", "text": " ".join(["word"] * 30), "id": "long"})
            await client.wait_event(lambda e: e["type"] == "speech.started", timeout=10)
            client.mic.play(music, 48_000)  # type: ignore[union-attr]
            await asyncio.wait_for(client.mic.done.wait(), 15)  # type: ignore[union-attr]
            await asyncio.sleep(0.3)
            async with http.get(f"{talk_server.url}/sessions/{client.session_id}") as resp:
                inbound = (await resp.json())["inbound"]
        finally:
            await client.close()
    assert inbound["windows"] > 150 and inbound["onsets"] == 0, inbound
    assert not [e for e in client.events if e["type"].startswith("user.")]
    assert not [e for e in client.events if e["type"] == "speech.ended" and e["interrupted"]]
