"""Fan-out parts without a network: subscriber queues, timelines, the shared encoder policy."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from agent.bitrate import EncoderTarget
from agent.config import Config, RoomSettings
from agent.fanout import FanoutSource, FanoutTrack, SharedEncoderControl, SubscriberWish
from agent.room import Room, RoomMember, SpeakerFeed
from signaling.rooms import offer_sends_audio
from tests.doubles import ToneEngine


async def test_a_full_subscriber_queue_drops_its_oldest_packets_only() -> None:
    source = FanoutSource("s", lambda target: None)
    slow, fast = FanoutTrack(queue_frames=3), FanoutTrack(queue_frames=3)
    source.subscribe(slow)
    source.subscribe(fast)
    source.publish(b"\xff")
    for track in (slow, fast):  # both connected: their senders pulled once
        assert bytes(await track.recv()) == b"\xff"
    for i in range(5):
        source.publish(bytes([i]))
        assert bytes(await fast.recv()) == bytes([i])  # the fast one keeps up
    # The slow one read no more: it holds the newest three, and counted two drops.
    assert [bytes(await slow.recv()) for _ in range(3)] == [b"\x02", b"\x03", b"\x04"]
    assert slow.dropped == 2 and fast.dropped == 0
    assert source.packets == 6


async def test_a_subscriber_not_pulled_yet_keeps_only_the_newest_packet_and_drops_none() -> None:
    """Bug (--room-send aiortc): a subscriber is made at its offer, seconds before aiortc's
    sender pulls it (after ICE and DTLS). Its queue filled meanwhile, each overflow counted
    as falling behind, and once connected the sender got 200 ms of stale audio at once."""
    source = FanoutSource("agent", lambda target: None)
    joiner = FanoutTrack(10)
    source.subscribe(joiner)
    for i in range(25):  # half a second of speech before the connection is up
        source.publish(bytes([i]) * 40, speech=True)
    assert bytes(await joiner.recv())[0] == 24  # the newest, and nothing stale after it
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(joiner.recv(), 0.05)
    assert joiner.dropped == 0
    source.publish(b"next")
    assert bytes(await joiner.recv()) == b"next"


async def test_pts_step_960_and_jump_forward_over_a_pause() -> None:
    source = FanoutSource("s", lambda target: None)
    track = FanoutTrack()
    source.subscribe(track)
    pts = []
    for _ in range(3):
        source.publish(b"x")
        pts.append((await track.recv()).pts)
    await asyncio.sleep(0.15)  # a stall (7 frames): timestamps stay continuous
    source.publish(b"y")
    pts.append((await track.recv()).pts)
    source.publish(b"y")  # ... and the clock moved: the next packet follows on
    pts.append((await track.recv()).pts)
    await asyncio.sleep(0.8)  # the source paused (a speaker left the slot): 40 frames
    source.publish(b"z")
    pts.append((await track.recv()).pts)
    assert pts[:5] == [0, 960, 1920, 2880, 3840], pts
    assert pts[5] % 960 == 0 and 37 * 960 <= pts[5] <= 50 * 960, pts


async def test_recv_waits_for_the_source_and_stop_ends_it() -> None:
    source = FanoutSource("s", lambda target: None)
    track = FanoutTrack()
    source.subscribe(track)
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.05)
    assert not pending.done()
    source.publish(b"late")
    assert bytes(await asyncio.wait_for(pending, 1)) == b"late"
    track.stop()
    assert source.subscribers == 0
    source.publish(b"after")  # a stopped subscriber gets nothing and costs nothing
    with pytest.raises(MediaStreamError):
        await asyncio.wait_for(track.recv(), 1)


def test_shared_encoder_follows_the_weakest_receiver() -> None:
    applied: list[EncoderTarget] = []
    control = SharedEncoderControl(applied.append)
    good = SubscriberWish(control, EncoderTarget(32_000, False, 0))
    good.set_bitrate(32_000)
    weak = SubscriberWish(control, EncoderTarget(32_000, False, 0))
    weak.set_bitrate(16_000)
    weak.set_fec(True)
    weak.set_expected_loss(9)
    assert applied[-1] == EncoderTarget(16_000, True, 9)
    weak.withdraw()  # the weak one left: the encoder climbs back
    assert applied[-1] == EncoderTarget(32_000, False, 0)
    other = SharedEncoderControl(applied.append)
    good.move_to(other)  # its slot now carries another speaker
    assert control.current == EncoderTarget(32_000, False, 0)
    assert other.current == EncoderTarget(32_000, False, 0)


def test_a_shared_encoder_codes_the_widest_band_its_listeners_play() -> None:
    """A room's encoder is shared: its band is capped (maxplaybackrate) only while every
    listener asked for a cap, at the widest of them; a listener with none lifts it."""
    applied: list[EncoderTarget] = []
    control = SharedEncoderControl(applied.append)
    phone = SubscriberWish(control, EncoderTarget(32_000, False, 0, 8_000))
    phone.set_bitrate(24_000)  # a controller's change keeps the receiver's rate
    assert applied[-1].max_playback_rate == 8_000
    wide = SubscriberWish(control, EncoderTarget(32_000, False, 0, 16_000))
    wide.set_bitrate(32_000)
    assert applied[-1].max_playback_rate == 16_000
    browser = SubscriberWish(control, EncoderTarget(32_000, False, 0, None))
    browser.set_bitrate(32_000)
    assert applied[-1].max_playback_rate is None
    browser.withdraw()
    assert applied[-1].max_playback_rate == 16_000


def test_offer_direction_decides_speaker_or_listener() -> None:
    head = "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n"
    audio = "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\n"
    assert offer_sends_audio(head + audio + "a=sendrecv\r\n")
    assert offer_sends_audio(head + audio)  # no attribute: sendrecv
    assert not offer_sends_audio(head + audio + "a=recvonly\r\n" + audio + "a=sendrecv\r\n")
    assert not offer_sends_audio(head + "m=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n")


def test_room_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="instruct"):
        RoomSettings(instruct="anyone")
    with pytest.raises(ValueError, match="max_participants"):
        RoomSettings(max_participants=0)


def test_room_settings_from_flags_and_environment() -> None:
    from signaling.cli import build_parser, config_from_args

    env = {"VOICE_AGENT_ROOM_MAX_SPEAKERS": "2", "VOICE_AGENT_ROOM_INSTRUCT": "hosts"}
    argv = ["serve", "--room-max-participants", "8", "--room-send", "aiortc"]
    rooms = config_from_args(build_parser(env).parse_args(argv), env).rooms
    assert (rooms.max_participants, rooms.max_speakers, rooms.instruct) == (8, 2, "hosts")
    assert rooms.direct_send is False
    defaults = config_from_args(build_parser({}).parse_args(["serve"]), {}).rooms
    assert defaults == RoomSettings()


async def test_without_the_expected_internals_the_track_uses_aiortcs_path() -> None:
    from agent.direct import DirectSender

    class Bare:  # a transceiver whose sender lacks aiortc 1.16's private attributes
        sender = object()

    source = FanoutSource("s", lambda target: None)
    track = FanoutTrack()
    track.use_direct(DirectSender(Bare()))
    source.subscribe(track)
    assert track.direct
    source.publish(b"one")  # resolve() finds nothing it knows: falls back, once and for all
    assert not track.direct
    assert bytes(await asyncio.wait_for(track.recv(), 1)) == b"one"


def test_a_speaker_whose_frames_stop_goes_quiet_once_and_a_quiet_return_stays_quiet() -> None:
    """The hold was only checked when a frame arrived: a speaker whose frames stopped stayed
    active. The room's timer (check_hold) ends it once; the loud level heard before the gap
    must not then flag the first quiet frame after it as speech."""
    room = Room("r", ToneEngine(), Config(rooms=RoomSettings()))
    member = room.join("s", speaking=True, host=True, expects_channel=False)
    feed = SpeakerFeed(room, member, mic=None)  # type: ignore[arg-type]
    room.slots[0] = feed
    events: list[tuple[bool, float]] = []

    def on_speaking(member: RoomMember, active: bool, level_dbfs: float) -> None:
        events.append((active, level_dbfs))

    room.on_speaking = on_speaking  # type: ignore[method-assign]
    loud = (np.sin(np.arange(960) / 8) * 8000).astype(np.int16)
    try:
        feed._on_frame(loud, 48_000)
        assert feed.active and member.speaking
        hold = RoomSettings().speaking_hold_s
        feed.check_hold(time.monotonic() + hold / 2)  # within the hold: still talking
        assert feed.active
        later = time.monotonic() + hold + 0.1
        feed.check_hold(later)
        feed.check_hold(later + 1)
        assert not feed.active and not member.speaking
        assert events == [(True, events[0][1]), (False, -100.0)]  # off once, at silence
        feed._on_frame(np.full(960, 30, dtype=np.int16), 48_000)  # quiet frames again
        assert not feed.active and len(events) == 2
    finally:
        feed.encoder.close()
        room.discard()


def test_a_rooms_last_speech_is_its_speakers_and_its_agents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The room's idle clock: the last loud microphone frame, or now while anyone talks."""
    room = Room("r", ToneEngine(), Config(rooms=RoomSettings()))
    try:
        assert room.last_speech(100.0) == -math.inf  # nobody talked yet
        room.heard_speech(50.0)
        assert room.last_speech(100.0) == 50.0
        room.slots[0] = SimpleNamespace(active=True)  # type: ignore[call-overload]
        assert room.last_speech(100.0) == 100.0  # a speaker within their hold
        room.slots[0] = None
        assert room.last_speech(120.0) == 100.0
        monkeypatch.setattr(type(room.pipeline), "sounding", property(lambda self: True))
        assert room.last_speech(130.0) == 130.0  # the agent talking
    finally:
        room.discard()
