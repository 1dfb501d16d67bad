"""A client that sends RTP under ever new SSRCs (signaling/ssrcguard.py)."""

from __future__ import annotations

import asyncio
import random
import struct
from typing import Any

import aiohttp
from aiortc import RTCRtpSender
from aiortc.rtcdtlstransport import RtpRouter
from aiortc.rtp import (
    RTCP_PSFB_APP,
    RTCP_RTPFB,
    RTCP_RTPFB_NACK,
    RTP_HISTORY_SIZE,
    HeaderExtensionsMap,
    RtcpPacket,
    RtcpPsfbPacket,
    RtpPacket,
    pack_rtcp_packet,
)

from signaling.keys import SESSIONS
from signaling.ssrcguard import MAX_INBOUND_SSRCS, MAX_NACKED, _GuardedRouter
from tests.conftest import LiveServer
from tests.mic import ClipMic
from tests.rtc_client import RtcClient


async def _flood_ssrcs(client: RtcClient, receiver: Any, packets: int) -> None:
    """Send ``packets`` Opus packets from ``client``, each under a new SSRC, over the
    client's own SRTP context (as any WebRTC stack could)."""
    sender = next(t.sender for t in client.pc.getTransceivers() if t.kind == "audio")
    codecs = receiver._RTCRtpReceiver__codecs
    pt = next(p for p, c in codecs.items() if c.mimeType.lower() == "audio/opus")
    extensions = HeaderExtensionsMap()
    base = random.getrandbits(31)
    for i in range(packets):
        packet = RtpPacket(
            payload_type=pt,
            sequence_number=i & 0xFFFF,
            timestamp=i * 960,
            ssrc=(base + i) & 0xFFFFFFFF,
            payload=b"\xf8\xff\xfe",  # an Opus frame of silence
        )
        await sender.transport._send_rtp(packet.serialize(extensions))
        if i % 50 == 0:
            await asyncio.sleep(0.001)  # let the server read its socket


async def test_rtp_under_ever_new_ssrcs_is_bounded_and_the_session_still_closes(
    live_server: LiveServer,
) -> None:
    """aiortc keeps state per remote SSRC for the connection's life and writes a report
    block per SSRC into each receiver report: past 255 packing it raised, the receiver's
    RTCP task died, and closing the session then waited forever (DELETE, the watchdog, the
    drain at shutdown). Found by review: 2000 packets under 2000 SSRCs did it. The router
    now learns at most MAX_INBOUND_SSRCS sources and drops the rest."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        client.mic = ClipMic()
        await client.connect()
        try:
            async with asyncio.timeout(20):
                while client.pc.connectionState != "connected":
                    await asyncio.sleep(0.05)
            assert client.session_id is not None
            registry = live_server.app[SESSIONS]
            peer = registry.get(client.session_id)
            [transceiver] = [t for t in peer.pc.getTransceivers() if t.kind == "audio"]
            receiver = transceiver.receiver
            await _flood_ssrcs(client, receiver, 1_000)
            await asyncio.sleep(2.0)  # at least one RTCP interval (0.5-1.5 s)
            router = receiver.transport._rtp_router
            assert len(router.ssrc_table) <= MAX_INBOUND_SSRCS, len(router.ssrc_table)
            assert len(receiver._RTCRtpReceiver__remote_streams) <= MAX_INBOUND_SSRCS
            assert len(receiver._RTCRtpReceiver__active_ssrc) <= MAX_INBOUND_SSRCS
            assert router.dropped > 500, router.dropped  # most of the 1000 (UDP may drop some)
            rtcp_task = receiver._RTCRtpReceiver__rtcp_task
            assert not rtcp_task.done(), rtcp_task.exception()
            async with asyncio.timeout(10):
                await registry.close(client.session_id)
        finally:
            await client.close()


async def test_a_malformed_remb_does_not_end_the_call(live_server: LiveServer) -> None:
    """A REMB claiming more SSRCs than it carries made aiortc's router raise struct.error
    (it catches only ValueError) out of the DTLS transport's receive loop: the transport
    closed, and with it the peer connection. One 20-byte packet ended the call (found by
    review). It is dropped; the call and its feedback go on."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            peer = live_server.app[SESSIONS].get(client.session_id or "")
            fci = b"REMB" + bytes([2, 0x04, 0x75, 0x30]) + (1234).to_bytes(4, "big")
            bad_remb = bytes(RtcpPsfbPacket(fmt=RTCP_PSFB_APP, ssrc=99, media_ssrc=0, fci=fci))
            transport = client.pc.getTransceivers()[0].sender.transport
            for _ in range(3):
                await transport._send_rtp(bad_remb)  # SRTCP: the client's own context
            await asyncio.sleep(1.0)
            assert peer.pc.connectionState == "connected"
            packets = peer.session.track.stats.packets
            await asyncio.sleep(0.5)
            assert peer.session.track.stats.packets > packets  # still sending
            routers = {
                t.receiver.transport._rtp_router.malformed_rtcp for t in peer.pc.getTransceivers()
            }
            assert routers == {3}
        finally:
            await client.close()


class _CountingTransport:
    """What aiortc's sender needs of its DTLS transport to send again: a state and a send."""

    state = "connected"

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def _send_rtp(self, data: bytes) -> None:
        self.sent.append(data)


async def test_a_nack_cannot_make_the_sender_send_a_packet_again_and_again() -> None:
    """One RTCP packet of 1.2 kB can list a sequence number 5000 times (290 FCIs of 17):
    aiortc's sender sent the packet again each time, ~0.5 MB and tens of ms of the event
    loop per NACK, as often as the peer liked (found by review). The guarded router keeps
    each number once and at most MAX_NACKED of them, the newest."""
    transport = _CountingTransport()
    sender = RTCRtpSender("audio", transport)  # type: ignore[arg-type]
    history = sender._RTCRtpSender__rtp_history  # type: ignore[attr-defined]
    for seq in range(1000, 1100):  # what it sent last, as its history keeps it
        history[seq % RTP_HISTORY_SIZE] = RtpPacket(
            payload_type=111, sequence_number=seq, ssrc=sender._ssrc, payload=b"\xf8" * 80
        )
    router = RtpRouter()
    router.__class__ = _GuardedRouter  # as limit_inbound_ssrcs sets it on a connection's
    router.register_sender(sender, sender._ssrc)

    async def nack(fcis: list[tuple[int, int]]) -> list[bytes]:
        """The packets sent again for a NACK of these (pid, bitmask) entries."""
        transport.sent.clear()
        payload = struct.pack("!LL", 1, sender._ssrc)
        payload += b"".join(struct.pack("!HH", pid, blp) for pid, blp in fcis)
        data = pack_rtcp_packet(RTCP_RTPFB, RTCP_RTPFB_NACK, payload)
        for parsed in RtcpPacket.parse(data):  # as it arrives: parsed, then routed
            for recipient in router.route_rtcp(parsed):
                await recipient._handle_rtcp_packet(parsed)
        return list(transport.sent)

    assert len(await nack([(1050, 0)] * 290)) == 1  # once, however often it is listed
    assert len(await nack([(1050, 0x7FFF)] * 290)) == 16  # 4640 entries, 16 numbers
    # 85 distinct numbers (1000-1084: 5 entries of 1 + 16): the newest MAX_NACKED.
    sent = await nack([(pid, 0xFFFF) for pid in range(1000, 1085, 17)])
    assert [RtpPacket.parse(p).sequence_number for p in sent] == list(range(1069, 1085))
    assert len(sent) == MAX_NACKED
    assert len(await nack([(1098, 0b1)])) == 2  # an ordinary NACK is untouched
    assert router.nacks_trimmed == 3  # type: ignore[attr-defined]
