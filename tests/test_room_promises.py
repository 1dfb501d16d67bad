"""Room promises (README "Rooms: several people and the agent") that no other test pinned:
found by hand mutation testing of agent/room.py, signaling/rooms.py, signaling/sessions.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import av
import numpy as np
import pytest

from agent.config import AdaptationSettings, Config, RoomSettings
from agent.fanout import FanoutTrack
from agent.opus import FRAME_SAMPLES, OpusEncoder
from agent.room import Room, RoomError, RoomMember, SpeakerFeed
from signaling.keys import SESSIONS
from tests.conftest import serve
from tests.doubles import ToneEngine, ToneMicrophone
from tests.rtc_client import ReceivedAudio, RtcClient, opus_fmtp_rewriter
from tests.test_speech_pipeline import Drain, wait_for

Event = dict[str, Any]


def msg(**fields: Any) -> str:
    return json.dumps(fields)


def of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e["type"] == kind]


def listen(member: RoomMember) -> list[Event]:
    sent: list[Event] = []
    member.outbox.send = sent.append  # type: ignore[method-assign,assignment]
    return sent


class SilentMic:
    """A microphone track that never yields a frame (the test feeds the room's feed)."""

    kind = "audio"

    async def recv(self) -> Any:
        await asyncio.Event().wait()


def tone(amplitude: float) -> np.ndarray:
    t = np.arange(FRAME_SAMPLES) / 48_000
    return (amplitude * 32767 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)


LOUD = tone(0.5)  # about -9 dBFS


# --- the agent's speaker.active ----------------------------------------------------------
async def test_the_agents_speaker_active_is_on_from_speech_started_to_speech_ended() -> None:
    """README: the agent's speaker.active is active from speech.started to speech.ended."""
    room = Room("r", ToneEngine(seconds_per_word=0.05), Config())
    room.pipeline.start()
    drain = Drain(room.pipeline)
    member = room.join("s", speaking=False, host=True, expects_channel=False)
    sent = listen(member)
    try:
        member.handle_message(msg(type="say", text="One two three.", id="u"))
        await wait_for(lambda: of(sent, "speech.ended"))
        agent = [
            (e["type"], e.get("active"))
            for e in sent
            if e["type"] in ("speech.started", "speech.ended")
            or (e["type"] == "speaker.active" and e["participant_id"] == "agent")
        ]
        assert agent == [
            ("speaker.active", True),
            ("speech.started", None),
            ("speaker.active", False),
            ("speech.ended", None),
        ], agent
    finally:
        drain.stop()
        await room.leave(member)


# --- a speaker's feed --------------------------------------------------------------------
async def test_a_speaker_who_leaves_while_talking_is_shown_quiet_and_its_encoder_freed() -> None:
    """A speaker leaving mid-word: the others are told it stopped talking (its slot is not
    left lit), and its microphone's encoder is closed while the room lives on."""
    room = Room("r", ToneEngine(), Config())
    speaker = room.join("sa", speaking=True, host=True, expects_channel=False)
    other = room.join("sb", speaking=False, host=True, expects_channel=False)
    sent = listen(other)
    room.start_speaker(speaker, SilentMic())  # type: ignore[arg-type]
    feed = room.slots[speaker.slot]  # type: ignore[index]
    assert feed is not None
    try:
        feed._on_frame(LOUD.copy(), 48_000)
        assert [e["active"] for e in of(sent, "speaker.active")] == [True]
        await room.leave(speaker)
        active = [(e["participant_id"], e["active"]) for e in of(sent, "speaker.active")]
        assert active == [(speaker.participant_id, True), (speaker.participant_id, False)]
        assert feed.encoder.closed, "a departed speaker's encoder was left open"
        assert room.slots[0] is None
    finally:
        await room.leave(other)


class FramesMic:
    """A microphone track that yields the given 20 ms frames, then ends."""

    kind = "audio"

    def __init__(self, frames: list[np.ndarray]) -> None:
        self._frames = list(frames)

    async def recv(self) -> av.AudioFrame:
        if not self._frames:
            await asyncio.Event().wait()
        pcm = self._frames.pop(0)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = 48_000
        return frame


async def test_with_encode_threads_a_speakers_voice_is_encoded_off_the_loop_in_order() -> None:
    """README --encode-threads: encoding off the event loop. A room's speakers were encoded
    on the loop whatever the flag said (four talking speakers: 200 encodes a second there).
    The packets must be the ones the loop would have made, in the order spoken."""
    threads: list[int] = []

    def record_threads(feed: SpeakerFeed) -> None:
        encode = feed.encoder.encode

        def recording_encode(pcm: np.ndarray) -> bytes:
            threads.append(threading.get_ident())
            return encode(pcm)

        feed.encoder.encode = recording_encode  # type: ignore[method-assign]

    with ThreadPoolExecutor(1) as executor:
        await _feed_through(executor, [tone(0.1 + 0.05 * i) for i in range(12)], record_threads)
    assert threads and threading.get_ident() not in threads, "encoded on the loop"


async def _feed_through(
    executor: ThreadPoolExecutor,
    frames: list[np.ndarray],
    watch: Callable[[SpeakerFeed], None] = lambda feed: None,
) -> None:
    """A listener of a speaker who says ``frames`` (encoded with ``executor``) gets the
    packets the loop would have made, in order; ``watch`` sees the feed before it runs."""
    chunks = [
        frame[start : start + FRAME_SAMPLES]
        for frame in frames
        for start in range(0, len(frame), FRAME_SAMPLES)
    ]
    room = Room("r", ToneEngine(), Config(), encode_executor=executor)
    speaker = room.join("sa", speaking=True, host=True, expects_channel=False)
    listener = FanoutTrack(queue_frames=100)
    listener._pulling = True  # as once aiortc's sender pulls: the queue keeps every packet
    room.start_speaker(speaker, FramesMic(frames))  # type: ignore[arg-type]
    feed = room.slots[speaker.slot]  # type: ignore[index]
    assert feed is not None
    watch(feed)
    feed.source.subscribe(listener)  # before the feed's task first runs
    try:
        await wait_for(lambda: len(listener._queue) == len(chunks), timeout=10)
        opus = Config().opus
        reference = OpusEncoder(
            bitrate=opus.bitrate,
            complexity=opus.complexity,
            fec=opus.fec,
            expected_loss_pct=opus.expected_loss_pct,
        )
        expected = [reference.encode(pcm) for pcm in chunks]
        reference.close()
        assert [payload for payload, _ in listener._queue] == expected
    finally:
        listener.stop()
        await room.leave(speaker)
        room.discard()


async def test_a_40ms_frame_is_encoded_off_the_loop_in_order() -> None:
    """A decoded frame longer than 20 ms (a 40 ms packet time) leaves several frames to
    encode: they go out in the order spoken (found by mutation testing)."""
    chunks = [tone(0.1 + 0.05 * i) for i in range(8)]
    with ThreadPoolExecutor(1) as executor:
        await _feed_through(executor, [np.concatenate(chunks[i : i + 2]) for i in range(0, 8, 2)])


async def test_encode_threads_shutting_down_still_encode_on_the_loop() -> None:
    """While the server shuts its encode threads down, a speaker's frames are still
    encoded, on the loop, not sent as empty packets (found by mutation testing)."""
    executor = ThreadPoolExecutor(1)
    executor.shutdown()
    await _feed_through(executor, [tone(0.1 + 0.05 * i) for i in range(4)])


# --- mute ----------------------------------------------------------------------------------
async def test_a_mute_that_changes_nothing_is_not_told_to_the_room() -> None:
    """README: mute tells the others "a change only" (a client re-syncing its button)."""
    room = Room("r", ToneEngine(), Config())
    a = room.join("sa", speaking=True, host=True, expects_channel=False)
    b = room.join("sb", speaking=False, host=True, expects_channel=False)
    sent = listen(b)
    try:
        a.handle_message(msg(type="mute", muted=False))  # already unmuted
        await asyncio.sleep(0.3)
        assert not of(sent, "participant.updated"), sent
        a.handle_message(msg(type="mute", muted=True))
        assert [e["muted"] for e in of(sent, "participant.updated")] == [True]
    finally:
        await room.leave(a)
        await room.leave(b)


@pytest.mark.parametrize("muted", ["yes", 1, None, []])
async def test_a_mute_that_is_not_a_boolean_is_refused(muted: object) -> None:
    room = Room("r", ToneEngine(), Config())
    a = room.join("sa", speaking=True, host=True, expects_channel=False)
    b = room.join("sb", speaking=False, host=True, expects_channel=False)
    mine, theirs = listen(a), listen(b)
    try:
        a.handle_message(msg(type="mute", muted=muted))
        await asyncio.sleep(0.3)
        assert [e["code"] for e in of(mine, "error")] == ["bad_message"], mine
        assert not of(theirs, "participant.updated"), theirs
        assert a.describe()["muted"] is False and a.muted is False
    finally:
        await room.leave(a)
        await room.leave(b)


# --- joining a closing room ----------------------------------------------------------------
async def test_a_room_whose_last_participant_left_refuses_joins_as_room_closed() -> None:
    """README: 409 room_closed while the room closes as its last participant leaves."""
    closed: list[Room] = []
    room = Room("r", ToneEngine(), Config(), on_closed=closed.append)
    member = room.join("sa", speaking=False, host=True, expects_channel=False)
    await room.leave(member)
    assert closed == [room]
    with pytest.raises(RoomError) as refused:
        room.join("sb", speaking=False, host=True, expects_channel=False)
    assert refused.value.code == "room_closed"
    assert not room.members


# --- media, end to end ---------------------------------------------------------------------
@pytest.mark.slow
async def test_the_last_speaker_slot_is_heard() -> None:
    """With --room-max-speakers 2 a client offering 2 slots hears the speaker in slot 1."""
    cfg = Config(host="127.0.0.1", port=0, rooms=RoomSettings(max_speakers=2))
    async with serve(cfg, ToneEngine()) as server, aiohttp.ClientSession() as http:
        a = RtcClient(server.url, http)
        b = RtcClient(server.url, http)
        try:
            await a.connect(room="two", mic=ToneMicrophone(1000.0), slots=2)
            await b.connect(room="two", mic=ToneMicrophone(1700.0), slots=2)
            await wait_for(lambda: len(a.slot_audio.get(1, _NONE).frames) > 10, timeout=10)
            await wait_for(lambda: len(b.slot_audio.get(0, _NONE).frames) > 10, timeout=10)
        finally:
            await a.close()
            await b.close()


_NONE = ReceivedAudio()


@pytest.mark.slow
async def test_a_speaker_joining_after_a_narrow_band_listener_codes_within_its_limits() -> None:
    """A speaker's one encoder takes the lowest bitrate its subscribers ask for (README
    "Bitrate policy"), a listener who joined before the speaker included: a receiver with
    maxaveragebitrate=16000 / maxplaybackrate=8000 must not be sent that speaker at more."""
    cfg = Config(host="127.0.0.1", port=0, rooms=RoomSettings())
    fmtp = "useinbandfec=1;maxaveragebitrate=16000;maxplaybackrate=8000"
    async with serve(cfg, ToneEngine()) as server, aiohttp.ClientSession() as http:
        listener = RtcClient(server.url, http)
        speaker = RtcClient(server.url, http)
        try:
            await listener.connect(room="narrow", slots=1, rewrite_offer=opus_fmtp_rewriter(fmtp))
            await speaker.connect(room="narrow", mic=ToneMicrophone(1000.0), slots=1)
            room = server.app[SESSIONS].rooms.get("narrow")
            assert room is not None
            await wait_for(lambda: room.slots[0] is not None, timeout=10)
            feed = room.slots[0]
            assert feed is not None
            await wait_for(lambda: feed.encodes > 0, timeout=10)
            encoder = feed.encoder
            assert encoder.bitrate <= 16_000, encoder.bitrate
            assert encoder.max_playback_rate == 8_000, encoder.max_playback_rate
        finally:
            await listener.close()
            await speaker.close()


# --- the role follows the offer -------------------------------------------------------------
def _offer(*sections: tuple[str, str | None]) -> str:
    lines = ["v=0", "o=- 1 1 IN IP4 0.0.0.0", "s=-", "t=0 0", "a=group:BUNDLE 0 1 2"]
    for mid, (media, direction) in enumerate(sections):
        lines += [f"m={media} 9 UDP/TLS/RTP/SAVPF 111", "c=IN IP4 0.0.0.0", f"a=mid:{mid}"]
        if direction is not None:
            lines.append(f"a={direction}")
        lines.append("a=rtpmap:111 opus/48000/2")
    return "\r\n".join(lines) + "\r\n"


@pytest.mark.parametrize(
    ("sections", "speaker"),
    [
        ([("audio", "sendrecv"), ("audio", "recvonly")], True),
        ([("audio", "sendonly"), ("audio", "recvonly")], True),
        ([("audio", "recvonly"), ("audio", "recvonly")], False),
        ([("audio", "inactive")], False),
        # No direction attribute means sendrecv (RFC 3264), whatever the slots say.
        ([("audio", None), ("audio", "recvonly"), ("audio", "recvonly")], True),
        ([("audio", None)], True),
        # Only the first audio section counts: a slot's direction does not.
        ([("audio", "recvonly"), ("audio", "sendrecv")], False),
        ([("video", "recvonly"), ("audio", "sendrecv")], True),
    ],
)
def test_the_role_follows_the_first_audio_sections_direction(
    sections: list[tuple[str, str | None]], speaker: bool
) -> None:
    from signaling.rooms import offer_sends_audio

    assert offer_sends_audio(_offer(*sections)) is speaker


@pytest.mark.slow
async def test_a_narrow_band_listener_who_leaves_no_longer_limits_the_agent() -> None:
    """The agent's one encoder takes the lowest bitrate of the subscribers present: once a
    listener capped at maxaveragebitrate=16000 leaves, its cap goes with it (it was kept,
    and the room heard the agent at 16 kbps for good). Adaptation off: fixed wishes."""
    cfg = Config(
        host="127.0.0.1", port=0, rooms=RoomSettings(), adaptation=AdaptationSettings(enabled=False)
    )
    fmtp = "useinbandfec=1;maxaveragebitrate=16000;maxplaybackrate=8000"
    async with serve(cfg, ToneEngine()) as server, aiohttp.ClientSession() as http:
        wide = RtcClient(server.url, http)
        narrow = RtcClient(server.url, http)
        try:
            await wide.connect(room="mixed", slots=1)
            await narrow.connect(room="mixed", slots=1, rewrite_offer=opus_fmtp_rewriter(fmtp))
            room = server.app[SESSIONS].rooms.get("mixed")
            assert room is not None
            encoder = room.agent_track.encoder
            assert encoder.bitrate == 16_000
            await narrow.close()
            await wait_for(lambda: len(room.members) == 1, timeout=10)
            assert encoder.bitrate == cfg.opus.bitrate > 16_000, encoder.bitrate
        finally:
            await wide.close()
            await narrow.close()


async def test_a_text_stream_from_a_participant_who_left_does_not_hang_the_rooms_agent() -> None:
    """Bug: a seat leaves the room before its peer connection closes, and aiortc still
    delivers data-channel messages in flight meanwhile. A text.delta then opened a stream
    owned by someone no longer in the room: forget_writer had run and the stalled-stream
    watchdog ends only present writers' streams, so every later say and chat reply waited
    behind it for the room's life. README: a writer who leaves mid-stream ends it."""
    config = Config()
    config = dataclasses.replace(
        config, speech=dataclasses.replace(config.speech, stream_idle_timeout_s=0.3)
    )
    room = Room("r", ToneEngine(seconds_per_word=0.05), config)
    room.start()
    leaver = room.join("sa", speaking=False, host=True, expects_channel=False)
    stayer = room.join("sb", speaking=False, host=True, expects_channel=False)
    heard = listen(stayer)
    try:
        await room.leave(leaver)
        leaver.handle_message(msg(type="text.delta", id="ghost", delta="Half a sentence"))
        stayer.handle_message(msg(type="say", text="Is anyone there?", id="real"))
        await wait_for(
            lambda: any(e["type"] == "speech.started" and e.get("id") == "real" for e in heard),
            timeout=5,
        )
        assert not [e for e in heard if e["type"] == "error"], heard
        assert all(e.get("id") != "ghost" for e in heard)
    finally:
        await room.leave(stayer)
