"""What a client can put on its microphone's RTP after a valid negotiation, and the
server's listening surviving it (agent/receive_buffer.py, agent/inbound.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiortc.rtp import HeaderExtensionsMap, RtpPacket

from signaling.keys import SESSIONS
from tests.clips import SPEECH_WAV, read_wav
from tests.conftest import LiveServer
from tests.mic import ClipMic
from tests.rtc_client import RtcClient

pytestmark = pytest.mark.timeout(60)


async def _listening_client(server: LiveServer, http: aiohttp.ClientSession) -> RtcClient:
    client = RtcClient(server.url, http)
    client.mic = ClipMic()
    await client.connect()
    deadline = time.monotonic() + 30
    while True:
        async with http.get(f"{server.url}/sessions/{client.session_id}") as resp:
            stats = await resp.json()
        if stats["inbound"] and stats["inbound"]["ready"] and stats["inbound"]["windows"] > 5:
            return client
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.1)


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
        client = await _listening_client(live_server, http)
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
