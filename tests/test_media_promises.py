"""Outgoing-media behaviour the other tests left unguarded (found by mutation testing of
agent/track.py, agent/speech.py, agent/opus.py, agent/direct.py and agent/fanout.py)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from types import SimpleNamespace
from typing import Any, cast

from aiortc.mediastreams import MediaStreamError

from agent.bitrate import EncoderTarget
from agent.config import SpeechSettings
from agent.direct import MAX_BUFFERED_BYTES, SR_CLOCK_EVERY, DirectSender
from agent.fanout import FanoutSource, FanoutTrack, SubscriberWish
from agent.opus import FRAME_SAMPLES, OpusEncoder, packet_has_fec
from agent.playout import PlayoutBuffer
from agent.speech import SpeechPipeline
from agent.track import OpusPacketTrack
from tests.doubles import ToneEngine
from tests.test_opus import encode_all, speech_like
from tests.test_track import tone_frame, unpaced
from tests.test_track_direct import RecordingSender

T0 = 1000.0  # an arbitrary loop time
FRAME_S = 0.02


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


# --- agent/track.py ----------------------------------------------------------------------
async def test_speech_arriving_mid_utterance_waits_for_its_tick() -> None:
    """Re-phasing is for speech *after silence* (README, Pacing): a frame that arrives while
    speech is flowing (the engine a little late, the buffer momentarily empty) goes at its
    tick, not the moment it lands, which would squeeze two speech packets together."""
    buffer = PlayoutBuffer(100)
    track = OpusPacketTrack(buffer)
    await track.recv()  # idle: one silence packet
    loop = asyncio.get_running_loop()
    puts: list[asyncio.Task[None]] = []

    def late_next_frame() -> None:
        # Fired right after the first speech packet went out: the next frame lands during
        # the wait for the following tick, with the buffer empty and speech flowing.
        puts.append(loop.create_task(buffer.put(tone_frame(1))))

    await buffer.put(tone_frame(0), (late_next_frame,))
    first = await track.recv()
    second = await track.recv()
    assert len(bytes(first)) > 40 and len(bytes(second)) > 40  # both speech
    assert track.stats.early_rephases == 0
    assert track._lead == 0.0
    assert first.pts is not None and second.pts == first.pts + FRAME_SAMPLES
    assert puts and puts[0].done()
    track.stop()


async def test_a_new_receiver_band_re_encodes_the_cached_silence() -> None:
    """set_max_playback_rate promises that silence made for another band is made again (as
    the other setters do); a same-band call changes nothing."""
    buffer = PlayoutBuffer(10)
    track = unpaced(OpusPacketTrack(buffer))
    for _ in range(6):
        await track.recv()  # the idle silence is cached by now
    calls = track.stats.encode_calls
    await track.recv()
    assert track.stats.encode_calls == calls  # replayed, not encoded
    track.set_max_playback_rate(8_000)
    assert track.encoder.max_playback_rate == 8_000
    await track.recv()
    assert track.stats.encode_calls == calls + 1  # made again for the narrow band
    for _ in range(6):
        await track.recv()
    calls = track.stats.encode_calls
    track.set_max_playback_rate(8_000)  # unchanged: the cache stays
    await track.recv()
    assert track.stats.encode_calls == calls
    track.stop()


async def test_stop_frees_the_tracks_encoder() -> None:
    """Sessions come and go for days: a stopped track's native encoder is destroyed then,
    not whenever the garbage collector gets to the track."""
    track = OpusPacketTrack(PlayoutBuffer(10))
    await track.recv()
    assert not track.encoder.closed
    track.stop()
    assert track.encoder.closed


# --- agent/speech.py ---------------------------------------------------------------------
async def test_audible_names_an_utterance_only_once_it_is_heard() -> None:
    """A room member who joins gets speech.started of ``audible``: an utterance generated
    into the buffer but not yet played has not started for anyone."""
    events: list[dict[str, Any]] = []
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(), events.append)
    pipeline.start()
    pipeline.say("one two", "a")
    buffer = pipeline.buffer
    await wait_for(lambda: len(buffer) > 0)
    assert pipeline.audible is None and not events
    frame = buffer.pop()
    assert frame is not None
    for mark in frame.marks:
        mark()
    assert events[0] == {"type": "speech.started", "id": "a"}
    assert pipeline.audible == "a"
    await pipeline.close()


async def test_audio_still_in_the_buffer_is_sounding_after_generation_ends() -> None:
    """Generation runs up to 3 s ahead of playout: the session is in use (idle timeout) until
    that audio has been played, not only while the engine makes it."""
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(), lambda event: None)
    pipeline.start()
    pipeline.say("one two three", "a")
    buffer = pipeline.buffer
    await wait_for(lambda: len(buffer) > 0)
    await wait_for(lambda: not buffer.producing)  # the engine is done
    assert len(buffer) > 0
    assert pipeline.sounding
    while buffer.pop() is not None:
        pass
    assert not pipeline.sounding
    await pipeline.close()


# --- agent/opus.py -----------------------------------------------------------------------
def test_fec_can_be_turned_off_again() -> None:
    """The controller turns FEC off on a clean network to spend the bits on the voice:
    set_fec(False) must reach libopus, not only the property."""
    pcm = speech_like(1.0)
    encoder = OpusEncoder(bitrate=24_000, fec=False, expected_loss_pct=20)
    assert not any(packet_has_fec(p) for p in encode_all(encoder, pcm))
    encoder.set_fec(True)
    assert sum(packet_has_fec(p) for p in encode_all(encoder, pcm)) > 25
    encoder.set_fec(False)
    assert not any(packet_has_fec(p) for p in encode_all(encoder, pcm)[2:])
    encoder.close()


# --- agent/direct.py ---------------------------------------------------------------------
class _Transport:
    def __init__(self, backlog: int = 0) -> None:
        self.backlog = backlog
        self.sent: list[bytes] = []

    def get_write_buffer_size(self) -> int:
        return self.backlog

    def sendto(self, data: bytes, addr: Any) -> None:
        self.sent.append(data)


def _resolved_sender(transport: Any) -> DirectSender:
    sender = DirectSender(SimpleNamespace(sender=SimpleNamespace()))
    pair = SimpleNamespace(protocol=SimpleNamespace(transport=transport), remote_addr=("h", 1))
    sender._ready = True
    sender._srtp = SimpleNamespace(protect=lambda packet: packet)
    sender._ice = SimpleNamespace(_nominated={1: pair})
    sender._sender = SimpleNamespace()  # receives the sender-report counters
    return sender


def test_a_backed_up_socket_drops_packets_instead_of_queueing_them() -> None:
    """README: a subscriber's packet is dropped when its socket has 64 KiB backed up."""
    transport = _Transport(backlog=MAX_BUFFERED_BYTES + 1)
    sender = _resolved_sender(transport)
    sender.send(b"opus", 0)
    assert transport.sent == [] and sender.dropped == 1 and sender.packets == 0
    transport.backlog = MAX_BUFFERED_BYTES
    sender.send(b"opus", 960)
    assert len(transport.sent) == 1 and sender.dropped == 1 and sender.packets == 1


async def test_send_dropped_survives_the_track_stopping_and_a_resume() -> None:
    """GET /sessions/{id} keeps a detached session's figures: ``send_dropped`` went back to
    0 once aiortc stopped the track, and a resumed session's new track counted from 0 again,
    while packets and bytes carried over (found by review)."""
    transport = _Transport(backlog=MAX_BUFFERED_BYTES + 1)  # every packet is dropped
    buffer = PlayoutBuffer(10)
    track = OpusPacketTrack(buffer)
    track.use_direct(_resolved_sender(transport))
    parked = asyncio.ensure_future(track.recv())
    await wait_for(lambda: track.send_dropped >= 3)
    track.stop()
    with contextlib.suppress(MediaStreamError):
        await parked
    dropped = track.send_dropped
    assert dropped >= 3
    # renew_track: a new track takes over the stats, and a new sender drops more.
    renewed = OpusPacketTrack(buffer)
    renewed.stats = track.stats
    renewed.use_direct(_resolved_sender(transport))
    parked = asyncio.ensure_future(renewed.recv())
    await wait_for(lambda: renewed.send_dropped > dropped)
    renewed.stop()
    with contextlib.suppress(MediaStreamError):
        await parked


def test_rtp_sequence_numbers_wrap_through_every_value() -> None:
    """After 65535 comes 0: skipping a number makes every receiver count a lost packet."""
    transport = _Transport()
    sender = _resolved_sender(transport)
    sender._seq = 0xFFFD
    for pts in (0, 960, 1920, 2880):
        sender.send(b"opus", pts)
    seqs = [struct.unpack("!H", data[2:4])[0] for data in transport.sent]
    assert seqs == [0xFFFE, 0xFFFF, 0, 1]


def test_sender_report_counters_follow_rfc_3550_from_the_first_packet() -> None:
    """RTCP sender reports: payload octets only (no RTP header), and a valid NTP/RTP time
    pair from the first packet on (a receiver's RTT and sync come from it)."""
    transport = _Transport()
    sender = _resolved_sender(transport)
    rtcp: Any = sender._sender
    payloads = [bytes(10 + i) for i in range(SR_CLOCK_EVERY + 1)]
    for i, payload in enumerate(payloads):
        sender.send(payload, i * FRAME_SAMPLES)
        if i == 0:
            first_ts = struct.unpack("!L", transport.sent[0][4:8])[0]
            assert rtcp._RTCRtpSender__rtp_timestamp == first_ts
            assert rtcp._RTCRtpSender__ntp_timestamp > 0
    assert rtcp._RTCRtpSender__packet_count == len(payloads)
    assert rtcp._RTCRtpSender__octet_count == sum(map(len, payloads))
    last_ts = struct.unpack("!L", transport.sent[-1][4:8])[0]
    assert rtcp._RTCRtpSender__rtp_timestamp == last_ts  # refreshed every SR_CLOCK_EVERY


# --- agent/fanout.py ---------------------------------------------------------------------
def test_a_pause_of_exactly_the_threshold_shows_as_a_timestamp_gap() -> None:
    """README: a source pause of 0.5 s or more shows as a timestamp gap (25 frames late)."""
    sender = RecordingSender()
    track = FanoutTrack()
    track.use_direct(cast(DirectSender, sender))
    track.push(b"before", T0)
    track.push(b"after", T0 + 0.53)  # 26 frames on the clock: 25 behind it
    pts = [p for _, _, p in sender.sent]
    assert pts == [0, 26 * FRAME_SAMPLES], pts


async def test_a_lean_subscriber_not_connected_yet_drops_rather_than_queues() -> None:
    """Before the connection is up nothing can be sent either way: queueing for aiortc's
    sender would hand it stale audio once it starts, in a second RTP stream beside the
    lean path's."""
    sender = RecordingSender(ready_after=3)
    track = FanoutTrack()
    track.use_direct(cast(DirectSender, sender))
    source = FanoutSource("s", lambda target: None)
    source.subscribe(track)
    for i in range(5):
        source.publish(bytes([i]) * 20)
    assert not track._queue and track.stats.packets == 2
    assert [payload[0] for _, payload, _ in sender.sent] == [3, 4]
    source.close()


def test_a_closed_sources_encoder_is_not_steered_by_late_feedback() -> None:
    """A speaker's feed closes its source, then its encoder: RTCP still arriving for a
    subscriber must not reach that closed encoder (nor keep the room alive by its apply)."""
    applied: list[EncoderTarget] = []
    source = FanoutSource("speaker", applied.append)
    wish = SubscriberWish(source.control, EncoderTarget(32_000, False, 0))
    wish.set_bitrate(24_000)
    assert applied[-1].bitrate == 24_000
    source.close()
    wish.set_bitrate(12_000)  # a receiver report after the close
    assert [t.bitrate for t in applied] == [24_000]
