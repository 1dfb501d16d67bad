"""What a client can put on its microphone's RTP after a valid negotiation, and the
server's listening surviving it (agent/receive_buffer.py, agent/inbound.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiortc.rtp import HeaderExtensionsMap, RtpPacket

from agent.config import Config, RoomSettings
from agent.receive_buffer import PromptAudioBuffer
from signaling.keys import SESSIONS
from tests.clips import SPEECH_WAV, read_wav
from tests.conftest import LiveServer, serve
from tests.doubles import ToneEngine
from tests.mic import ClipMic
from tests.rtc_client import RtcClient
from tests.test_conversation_e2e import connect_with_mic

pytestmark = pytest.mark.timeout(60)


async def _send_on_mic(client: RtcClient, receiver: Any, seq: int, payload: bytes) -> None:
    """One RTP packet under the client's microphone SSRC, over its own SRTP context."""
    sender = next(t.sender for t in client.pc.getTransceivers() if t.kind == "audio")
    codecs = receiver._RTCRtpReceiver__codecs
    pt = next(p for p, c in codecs.items() if c.mimeType.lower() == "audio/opus")
    packet = RtpPacket(
        payload_type=pt,
        sequence_number=seq & 0xFFFF,
        timestamp=0,
        ssrc=sender._ssrc,
        payload=payload,
    )
    await sender.transport._send_rtp(packet.serialize(HeaderExtensionsMap()))


async def test_an_empty_rtp_payload_does_not_deafen_the_microphone(
    live_server: LiveServer,
) -> None:
    """An RTP packet with no payload (a header alone: padding-only, or hostile) went to
    libavcodec as an empty packet, which it takes for the end of the stream: every later
    packet failed to decode ('End of file'; aiortc logs a warning per packet and carries on),
    so one packet left the session deaf for the rest of the call (no turn, no barge-in).
    Found by review. An empty payload now carries no frame and costs its sequence number."""
    samples, rate = read_wav(SPEECH_WAV)
    async with aiohttp.ClientSession() as http:
        client = await connect_with_mic(live_server, http)
        try:
            peer = live_server.app[SESSIONS].get(client.session_id)
            [transceiver] = [t for t in peer.pc.getTransceivers() if t.kind == "audio"]
            receiver = transceiver.receiver
            buffer = receiver._RTCRtpReceiver__jitter_buffer
            assert buffer._next is not None
            await _send_on_mic(client, receiver, buffer._next + 2, b"")
            await asyncio.sleep(0.3)
            client.mic.play(samples, rate)  # type: ignore[union-attr]
            await client.wait_event(lambda e: e["type"] == "user.speech.started", timeout=8)
        finally:
            await client.close()


async def test_an_empty_rtp_payload_does_not_silence_a_room_speaker() -> None:
    """The same packet on a room speaker's microphone: the room kept aiortc's own jitter
    buffer for speakers, which hands the empty frame to the decoder, so one packet silenced
    that speaker for everyone for the rest of the call (found by review). Speakers' receivers
    now have the prompt buffer too (which also takes aiortc's 80 ms out of every voice
    relayed: the listeners' browsers buffer for playout)."""
    config = Config(host="127.0.0.1", port=0, rooms=RoomSettings())
    mic = ClipMic()
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        talker = RtcClient(server.url, http)
        watcher = RtcClient(server.url, http)
        try:
            await talker.connect(room="hostile", mic=mic, slots=1)
            await watcher.connect(room="hostile", slots=1)
            peer = server.app[SESSIONS].get(talker.session_id)
            receiver = next(t for t in peer.pc.getTransceivers() if t.kind == "audio").receiver
            buffer = receiver._RTCRtpReceiver__jitter_buffer
            assert isinstance(buffer, PromptAudioBuffer)
            deadline = time.monotonic() + 10
            while buffer._next is None:  # the microphone's silence is arriving
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            # Ahead of every packet received: SRTP drops a sequence number seen before.
            await _send_on_mic(talker, receiver, buffer._next + 2, b"")
            await asyncio.sleep(0.3)
            t = np.arange(48_000) / 48_000
            mic.play(0.5 * np.sin(2 * np.pi * 1000 * t), 48_000)
            pid = talker.participant_id
            await watcher.wait_event(
                lambda e: e["type"] == "speaker.active" and e["participant_id"] == pid,
                timeout=5,
            )
        finally:
            await watcher.close()
            await talker.close()
