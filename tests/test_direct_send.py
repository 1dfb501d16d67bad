"""A 1:1 session's lean send path (agent/direct.py) against a real aiortc client: the audio
arrives intact on it and on aiortc's path (``--send-path aiortc``), and with transport-cc
every packet on the wire carries the next transport-wide sequence number, recorded for the
feedback that will name it."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest

from agent.config import Config, OpusSettings, RoomSettings
from agent.direct import DirectSender
from agent.session import AgentSession
from signaling.keys import SESSIONS
from tests.conftest import LiveServer, serve
from tests.doubles import ToneEngine, ToneMicrophone, tone_frequency
from tests.rtc_client import RtcClient, opus_fmtp_rewriter
from tests.test_e2e_python import _speak_and_record, dominant_frequency, speech_span

TWCC_EXT_ID = 7  # the id opus_fmtp_rewriter offers the extension under


@pytest.fixture
def server_config(request: pytest.FixtureRequest) -> Config:
    return Config(host="127.0.0.1", opus=OpusSettings(direct_send=getattr(request, "param", True)))


def _session(live_server: LiveServer, client: RtcClient) -> AgentSession:
    assert client.session_id is not None
    session = live_server.app[SESSIONS].get(client.session_id).session
    assert isinstance(session, AgentSession)
    return session


@pytest.mark.parametrize("server_config", [True, False], indirect=True, ids=["direct", "aiortc"])
async def test_speech_arrives_intact_on_either_send_path(
    live_server: LiveServer, server_config: Config
) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            text = "one two three four five six"
            audio, events = await _speak_and_record(client, text)
            track = _session(live_server, client).track
            assert track.direct is server_config.opus.direct_send
            assert track.stats.direct_errors == 0
            if track.direct:
                sender = track._direct
                assert sender is not None and sender.dropped == 0 and sender.packets > 50
                # aiortc's RTCP sender reports count what the lean path sent.
                assert client.session_id is not None
                pc = live_server.app[SESSIONS].get(client.session_id).pc
                (rtp_sender,) = pc.getSenders()
                assert rtp_sender._RTCRtpSender__packet_count == sender.packets
                assert rtp_sender._RTCRtpSender__octet_count == sender.octets
        finally:
            await client.close()
    first, last = speech_span(audio)
    voiced = audio[first : last + 1]
    assert 1.4 < len(voiced) / 48_000 < 1.6  # 6 words at 0.25 s
    assert abs(dominant_frequency(voiced[9600:-9600]) - tone_frequency(text)) < 5
    windows = voiced[: len(voiced) // 960 * 960].reshape(-1, 960)
    assert (np.sqrt((windows**2).mean(axis=1)) > 0.2).all()  # no dropout anywhere
    kinds = [e["type"] for e in events if e["type"] in ("speech.started", "speech.ended")]
    assert kinds == ["speech.started", "speech.ended"]


class WireRecorder:
    """Wraps a DirectSender's SRTP session: keeps every clear RTP packet it protects."""

    def __init__(self, srtp: Any) -> None:
        self.srtp = srtp
        self.packets: list[bytes] = []

    def protect(self, packet: bytes) -> bytes:
        self.packets.append(bytes(packet))
        return bytes(self.srtp.protect(packet))


async def _wait_direct(track: Any) -> Any:
    for _ in range(200):
        if track.direct and track._direct.resolve():
            return track._direct
        await asyncio.sleep(0.01)
    raise AssertionError("the lean send path never started")


async def _packets_of_one_utterance(client: RtcClient, track: Any) -> list[bytes]:
    """The clear RTP packets ``track``'s lean path sends while the agent says one thing."""
    sender = await _wait_direct(track)
    recorder = WireRecorder(sender._srtp)
    sender._srtp = recorder
    try:
        client.send({"type": "say", "text": "one two three four", "id": "u1"})
        await client.wait_event(lambda e: e["type"] == "speech.ended")
    finally:
        sender._srtp = recorder.srtp
    return recorder.packets


def _check_sequenced(packets: list[bytes], history: Any) -> None:
    assert len(packets) > 45  # 1 s of speech, and the silence around it
    sequences = [_twcc_sequence(packet) for packet in packets]
    assert all(s is not None for s in sequences)
    steps = np.diff(np.array(sequences, dtype=np.int64)) % 0x10000
    assert (steps == 1).all()  # one number per packet, none skipped, none repeated
    for packet, seq in zip(packets, sequences, strict=True):
        sent = history.get(seq or 0)
        assert sent is not None and sent.size_bytes == len(packet) - _payload_offset(packet)


async def test_transport_wide_sequence_numbers_on_the_wire(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect(rewrite_offer=opus_fmtp_rewriter("useinbandfec=1", True))
        try:
            session = _session(live_server, client)
            tap = session.network.tap
            assert tap is not None and tap.transport_cc
            packets = await _packets_of_one_utterance(client, session.track)
        finally:
            await client.close()
    _check_sequenced(packets, tap._history)


async def test_room_listeners_get_transport_wide_sequence_numbers_too() -> None:
    config = Config(host="127.0.0.1", port=0, rooms=RoomSettings(direct_send=True))
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        client = RtcClient(server.url, http)
        await client.connect(room="twcc", rewrite_offer=opus_fmtp_rewriter("", True))
        try:
            room = server.app[SESSIONS].rooms.get("twcc")
            assert room is not None
            (member,) = room.members.values()
            sub = member._subs[0]  # the agent's track
            assert sub.tap is not None and sub.tap.transport_cc
            packets = await _packets_of_one_utterance(client, sub.track)
        finally:
            await client.close()
    _check_sequenced(packets, sub.tap._history)


def _extension_elements(packet: bytes) -> dict[int, bytes]:
    """RFC 8285 one-byte header extension elements of an RTP packet, by id."""
    assert packet[0] & 0x10, "no header extension"
    csrcs = packet[0] & 0x0F
    offset = 12 + 4 * csrcs
    profile, words = struct.unpack_from("!HH", packet, offset)
    assert profile == 0xBEDE
    data = packet[offset + 4 : offset + 4 + 4 * words]
    elements: dict[int, bytes] = {}
    i = 0
    while i < len(data):
        if data[i] == 0:  # padding
            i += 1
            continue
        ident, length = data[i] >> 4, (data[i] & 0x0F) + 1
        elements[ident] = data[i + 1 : i + 1 + length]
        i += 1 + length
    return elements


def _twcc_sequence(packet: bytes) -> int | None:
    value = _extension_elements(packet).get(TWCC_EXT_ID)
    return None if value is None or len(value) != 2 else int(struct.unpack("!H", value)[0])


def _payload_offset(packet: bytes) -> int:
    csrcs = packet[0] & 0x0F
    offset = 12 + 4 * csrcs
    _, words = struct.unpack_from("!HH", packet, offset)
    return offset + 4 + 4 * words


class _Sink:
    """A relayed (TURN) transport as aioice has it: sendto, but no write-buffer size."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def sendto(self, data: bytes, addr: Any) -> None:
        self.sent.append((data, addr))


def _resolved_sender(transport: Any) -> DirectSender:
    sender = DirectSender(SimpleNamespace(sender=SimpleNamespace()))
    pair = SimpleNamespace(protocol=SimpleNamespace(transport=transport), remote_addr=("h", 1))
    sender._ready = True
    sender._srtp = SimpleNamespace(protect=lambda packet: b"S" + packet)
    sender._ice = SimpleNamespace(_nominated={1: pair})
    sender._sender = SimpleNamespace()  # receives the sender-report counters
    return sender


def test_a_relayed_pair_without_a_write_buffer_size_still_gets_packets() -> None:
    sink = _Sink()
    sender = _resolved_sender(sink)
    for pts in (0, 960, 1920):
        sender.send(b"opus", pts)
    assert len(sink.sent) == 3 and sender.dropped == 0
    assert all(data.startswith(b"S\x80") and data.endswith(b"opus") for data, _ in sink.sent)


def test_rtp_sequence_numbers_start_in_the_lower_half() -> None:
    """Like aiortc and libwebrtc: an early wrap-around can break SRTP index estimation."""
    starts = [DirectSender(SimpleNamespace(sender=None))._seq for _ in range(2000)]
    assert max(starts) < 0x8000 and len(set(starts)) > 1000


async def test_a_room_participants_streams_share_one_transport_wide_sequence() -> None:
    # A listener's connection carries the agent and a speaker slot on one bundled transport:
    # transport-cc numbers count across the transport, so feedback names each packet once.
    # Each sender used to count from 0 on its own: 74 of 150 numbers were sent twice.
    config = Config(host="127.0.0.1", port=0, rooms=RoomSettings(direct_send=True))
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        speaker, listener = RtcClient(server.url, http), RtcClient(server.url, http)
        with_twcc = opus_fmtp_rewriter("", True)
        await speaker.connect(
            room="tw", mic=ToneMicrophone(1000.0), slots=2, rewrite_offer=with_twcc
        )
        await listener.connect(room="tw", slots=2, rewrite_offer=with_twcc)
        try:
            room = server.app[SESSIONS].rooms.get("tw")
            member = next(m for m in room.members.values() if m.slot is None)
            subs = [member._subs[0], member._slots[0]]  # the agent, the speaker's slot
            assert subs[0].tap.sender.transport is subs[1].tap.sender.transport
            senders = [await _wait_direct(sub.track) for sub in subs]
            recorders = [WireRecorder(sender._srtp) for sender in senders]
            for sender, recorder in zip(senders, recorders, strict=True):
                sender._srtp = recorder
            listener.send({"type": "say", "text": "one two three four", "id": "u1"})
            await asyncio.sleep(1.0)
            for sender, recorder in zip(senders, recorders, strict=True):
                sender._srtp = recorder.srtp
        finally:
            await listener.close()
            await speaker.close()
    agent, slot = ([_twcc_sequence(p) for p in r.packets] for r in recorders)
    assert len(agent) > 25 and len(slot) > 25  # both streams flowed
    sent = agent + slot
    assert None not in sent
    assert len(set(sent)) == len(sent)  # no number twice on the transport
    # One counter: together they are a run of consecutive numbers.
    assert max(sent) - min(sent) + 1 == len(sent)  # type: ignore[type-var,operator]
