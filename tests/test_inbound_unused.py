"""What the agent does not listen to is not received: a section it sends nothing on is
answered inactive, and a room member's audio other than a speaker's microphone sendonly.
aiortc decodes whatever a receiver gets into a queue only a reader empties: unread, it grew
~200 KB/s per track for the whole call (video at a video decoder's CPU cost too)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import VideoStreamTrack

from agent.config import RoomSettings
from signaling.keys import SESSIONS
from tests.conftest import LiveServer
from tests.doubles import ToneMicrophone
from tests.rtc_client import RtcClient
from tests.test_rooms_e2e import room_server

pytestmark = [pytest.mark.timeout(60)]

MAX_QUEUED_FRAMES = 25  # 0.5 s: what a reader a moment late leaves


def _receiving(server: LiveServer, session_id: str) -> list[tuple[str, str | None, int]]:
    """Each server transceiver's kind, negotiated direction and frames queued unread."""
    peer = server.app[SESSIONS].get(session_id)
    assert peer is not None
    return [
        (
            t.kind,
            t.currentDirection,
            t.receiver.track._queue.qsize() if t.receiver.track is not None else 0,
        )
        for t in peer.pc.getTransceivers()
    ]


async def test_a_whep_room_guest_that_sends_audio_is_not_received() -> None:
    async with room_server() as server, aiohttp.ClientSession() as http:
        guest = RtcClient(server.url, http)
        try:
            # Its offer is sendrecv, but a WHEP guest listens: nothing of it is read.
            await guest.connect(room="w", whep=True, mic=ToneMicrophone(1000.0))
            await asyncio.sleep(2.0)
            receiving = _receiving(server, guest.session_id)
        finally:
            await guest.close()
    assert receiving == [("audio", "sendonly", 0)], receiving


async def test_a_speakers_slots_offered_sendrecv_are_not_received() -> None:
    async with room_server(RoomSettings(max_speakers=2)) as server, aiohttp.ClientSession() as http:
        client = RtcClient(server.url, http)
        try:
            client.pc.addTransceiver(ToneMicrophone(1000.0), direction="sendrecv")  # audio 0
            client.pc.addTransceiver(ToneMicrophone(1700.0), direction="sendrecv")  # slot 0
            await client.connect(room="s2", slots=0)  # + a recvonly one, slot 1
            await asyncio.sleep(2.0)
            receiving = _receiving(server, client.session_id)
        finally:
            await client.close()
    # A speaker (its first audio sends): that microphone is heard, its slots are not.
    directions = [(kind, direction) for kind, direction, _ in receiving]
    assert directions == [("audio", "sendrecv"), ("audio", "sendonly"), ("audio", "sendonly")]
    assert max(queued for *_, queued in receiving) <= MAX_QUEUED_FRAMES, receiving


async def test_video_and_a_second_audio_of_a_call_are_answered_inactive(
    live_server: LiveServer,
) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            client.pc.addTransceiver(VideoStreamTrack(), direction="sendrecv")
            client.pc.addTransceiver(ToneMicrophone(1700.0), direction="sendrecv")
            await client.connect(mic=ToneMicrophone(1000.0))
            client.send({"type": "say", "text": "still heard", "id": "heard"})
            await client.wait_event(lambda e: e["type"] == "speech.ended", 10)
            receiving = _receiving(live_server, client.session_id)
        finally:
            await client.close()
    # The microphone (first audio, the agent's voice back) is listened to; the rest is not.
    directions = sorted((kind, direction) for kind, direction, _ in receiving)
    assert directions == [("audio", "inactive"), ("audio", "sendrecv"), ("video", "inactive")]
    assert max(queued for *_, queued in receiving) <= MAX_QUEUED_FRAMES, receiving


async def test_a_microphone_on_the_second_audio_section_is_heard(live_server: LiveServer) -> None:
    """A client that offers the agent's voice recvonly first, then its microphone
    sendonly (addTransceiver twice): the microphone's section was answered inactive as
    one the agent sends nothing on, and the session listened to a silent track."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        pc.addTransceiver("audio", direction="recvonly")  # the agent's voice
        mic_t = pc.addTransceiver(ToneMicrophone(1000.0), direction="sendonly")
        channel = pc.createDataChannel("agent")
        opened = asyncio.Event()
        channel.on("open", opened.set)
        await pc.setLocalDescription(await pc.createOffer())
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                live_server.url + "/offer", json={"sdp": pc.localDescription.sdp, "type": "offer"}
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
            data = await resp.json()
        await pc.setRemoteDescription(RTCSessionDescription(sdp=data["sdp"], type="answer"))
        await asyncio.wait_for(opened.wait(), 10)
        await asyncio.sleep(2.0)
        peer = live_server.app[SESSIONS].get(data["session_id"])
        inbound = peer.session.inbound
        server_t = next(t for t in peer.pc.getTransceivers() if t.receiver.track is inbound.track)
        state = (server_t.currentDirection, mic_t.currentDirection, inbound.stats.frames)
    finally:
        await pc.close()
    assert state[2] > 0, f"the session listens to a track answered {state[0]!r}: deaf ({state})"
