"""The microphone's receive buffer (agent/receive_buffer.py).

aiortc's JitterBuffer(16, prefetch=0), which the agent used before, stalled at one lost
packet until 16 were queued and then released one frame per arriving packet: every later
frame reached the VAD 14 frames (280 ms) late for the rest of the call.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import aiohttp
import pytest
from aiortc import RTCRtpReceiver
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtp import RtpPacket

from agent.receive_buffer import PromptAudioBuffer, install_receive_buffer

FRAME_TICKS = 960  # 20 ms at Opus's 48 kHz RTP clock


def packet(seq: int, ssrc: int = 0) -> RtpPacket:
    rtp = RtpPacket(
        payload_type=111, sequence_number=seq % 65536, timestamp=seq * FRAME_TICKS, ssrc=ssrc
    )
    rtp._data = seq.to_bytes(4, "big")  # type: ignore[attr-defined]  # aiortc's depayloaded data
    return rtp


def feed(buffer: JitterBuffer, order: list[int]) -> list[tuple[int, int | None]]:
    """(arriving sequence number, the frame released then, as its number or None)."""
    out = []
    for seq in order:
        pli, frame = buffer.add(packet(seq))
        assert pli is False
        out.append((seq, None if frame is None else int.from_bytes(frame.data, "big")))
    return out


def lags(released: list[tuple[int, int | None]]) -> dict[int, int]:
    return {arrived: arrived - frame for arrived, frame in released if frame is not None}


def test_one_lost_packet_does_not_delay_the_rest_of_the_call() -> None:
    order = [seq for seq in range(400) if seq != 50]
    ours = lags(feed(PromptAudioBuffer(), order))
    assert set(ours.values()) == {0}  # every packet released as it arrives
    assert len(ours) == 399
    aiortcs = lags(feed(JitterBuffer(16, 0), order))  # what the agent used before
    assert aiortcs[399] >= 14


def test_each_packet_is_released_in_order_as_it_arrives() -> None:
    buffer = PromptAudioBuffer()
    released = feed(buffer, list(range(1000, 1100)))
    assert [frame for _, frame in released] == list(range(1000, 1100))
    frame = buffer.add(packet(1100))[1]
    assert frame is not None and frame.timestamp == 1100 * FRAME_TICKS
    assert (buffer.given_up, buffer.dropped_late) == (0, 0)


def test_a_reordered_packet_counts_as_lost_by_default() -> None:
    buffer = PromptAudioBuffer()
    released = feed(buffer, [1, 2, 4, 3, 5, 6])
    assert released == [(1, 1), (2, 2), (4, 4), (3, None), (5, 5), (6, 6)]
    assert (buffer.given_up, buffer.dropped_late) == (1, 1)


def test_reorder_wait_keeps_the_order_at_a_bounded_delay() -> None:
    buffer = PromptAudioBuffer(reorder_wait=1)
    released, queued = [], []
    for seq in [1, 2, 4, 3, 5, 7, 8, 9, 10, 12, 11, 13]:  # 3 and 11 late by one, 6 lost
        released += feed(buffer, [seq])
        queued.append(buffer.queued)
    frames = [frame for _, frame in released if frame is not None]
    assert frames == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]
    assert max(queued) == 1  # one frame (20 ms) behind at most, after any number of events
    assert (buffer.given_up, buffer.dropped_late) == (1, 0)


def test_sequence_numbers_wrap() -> None:
    released = feed(PromptAudioBuffer(), [65534, 65535, 65536, 65538, 65539])
    assert [frame for _, frame in released] == [65534, 65535, 65536, 65538, 65539]


def test_a_long_burst_loss_or_a_sender_restart_starts_over() -> None:
    buffer = PromptAudioBuffer(reorder_wait=2)
    released = feed(buffer, [10, 11, 12, 500, 501, 502, 9000, 9001])
    assert [frame for _, frame in released] == [10, 11, 12, 500, 501, 502, 9000, 9001]
    assert buffer.given_up == (500 - 13) + (9000 - 503)


def test_duplicates_and_stale_packets_are_dropped() -> None:
    buffer = PromptAudioBuffer()
    released = feed(buffer, [5, 6, 6, 5, 7])
    assert released == [(5, 5), (6, 6), (6, None), (5, None), (7, 7)]
    assert buffer.dropped_late == 2


def test_reorder_wait_must_leave_room_in_the_buffer() -> None:
    with pytest.raises(ValueError, match="reorder_wait"):
        PromptAudioBuffer(16, reorder_wait=15)


def test_it_replaces_aiortcs_buffer_in_a_real_receiver() -> None:
    """Guards the aiortc internals it relies on (a private attribute of RTCRtpReceiver)."""

    class Transport:  # what RTCRtpReceiver reads from its DTLS transport
        state = "new"
        _rtp_router = None

        def _register_rtp_receiver(self, *args: object) -> None:
            pass

    receiver = RTCRtpReceiver("audio", Transport())  # type: ignore[arg-type]
    assert install_receive_buffer(receiver, 0)
    installed = receiver._RTCRtpReceiver__jitter_buffer  # type: ignore[attr-defined]
    assert isinstance(installed, PromptAudioBuffer)
    assert not install_receive_buffer(receiver, 0)  # not aiortc's buffer any more: left alone


async def test_upstream_loss_adds_no_delay_end_to_end(live_server: Any) -> None:
    """Real loss on the microphone's way in (the tests' UDP relay drops 5 % of its RTP): the
    server's microphone path keeps up with what arrives. With aiortc's buffer each session
    fell ~14 frames behind at the first lost packet and stayed there."""
    from signaling.keys import SESSIONS
    from tests.mic import ClipMic
    from tests.netem import relayed_client

    def with_mic(client: Any) -> None:
        client.mic = ClipMic()  # sends 20 ms packets (silence) from the start

    relay_kwargs = {"seed": 3, "upstream_loss": 0.05}
    async with (
        aiohttp.ClientSession() as http,
        relayed_client(live_server.url, http, relay_kwargs, prepare=with_mic) as (client, relay),
    ):
        peer = live_server.app[SESSIONS].get(client.session_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while (peer.session.inbound is None or peer.session.inbound.stats.frames == 0) and (
            loop.time() < deadline
        ):
            await asyncio.sleep(0.05)
        inbound = peer.session.inbound
        assert inbound is not None and inbound.stats.frames > 0
        (receiver,) = [r for r in peer.pc.getReceivers() if r.track.kind == "audio"]
        buffer = receiver._RTCRtpReceiver__jitter_buffer
        assert isinstance(buffer, PromptAudioBuffer)
        behind = []
        while relay.upstream.rtp_dropped < 8 and loop.time() < deadline:
            await asyncio.sleep(0.1)
            # Frames that crossed the relay but have not reached the VAD's reader yet.
            behind.append(relay.upstream.rtp_forwarded - inbound.stats.frames)
        assert relay.upstream.rtp_dropped >= 8, relay.upstream
        assert buffer.given_up >= relay.upstream.rtp_dropped - 1  # each loss skipped at once
        assert statistics.median(behind) <= 3, behind
        assert max(behind[len(behind) // 2 :]) <= 6, behind
