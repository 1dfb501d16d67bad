"""The track on its lean send path: it paces itself with loop timers and hands packets to a
DirectSender (here a recording double: the real one needs a connected peer connection and is
covered end to end in tests/test_direct_send.py)."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from agent.opus import FRAME_SAMPLES
from agent.playout import PlayoutBuffer
from agent.track import FRAME_SECONDS, OpusPacketTrack
from tests.test_track import fail_third_encode, tone_frame

pytestmark = pytest.mark.serial  # pacing and onset times are measured alone


@dataclass
class RecordingSender:
    """Stands in for agent.direct.DirectSender: records what the track sends, and when."""

    ready_after: int = 0  # resolve() fails this many times first (connection not up yet)
    fail_sends: set[int] = field(default_factory=set)  # indices of sends that raise
    usable: bool = True
    sent: list[tuple[float, bytes, int]] = field(default_factory=list)
    resolves: int = 0
    attempts: int = 0
    dropped: int = 0  # packets DirectSender would have dropped (none here)

    def resolve(self) -> bool:
        self.resolves += 1
        return self.resolves > self.ready_after

    def send(self, payload: bytes, pts: int) -> None:
        self.attempts += 1
        if self.attempts - 1 in self.fail_sends:
            raise OSError("sendto failed")
        self.sent.append((time.monotonic(), payload, pts))


def direct_track(buffer: PlayoutBuffer, sender: RecordingSender, **kw: object) -> OpusPacketTrack:
    track = OpusPacketTrack(buffer, **kw)  # type: ignore[arg-type]
    track.use_direct(sender)  # type: ignore[arg-type]
    return track


async def until(predicate: object, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_paces_itself_gapless_while_aiortc_task_stays_parked() -> None:
    buffer = PlayoutBuffer(100)
    sender = RecordingSender()
    track = direct_track(buffer, sender)
    parked = asyncio.ensure_future(track.recv())  # what aiortc's RTP task does
    await until(lambda: len(sender.sent) >= 51)
    assert not parked.done() and track.direct
    stamps = [s[0] for s in sender.sent[:51]]
    assert 0.95 < stamps[-1] - stamps[0] < 1.1  # 50 intervals of 20 ms
    assert [s[2] for s in sender.sent[:51]] == [i * FRAME_SAMPLES for i in range(51)]
    assert np.max(np.diff(stamps)) < 0.06  # no hole; the machine may jitter a little
    assert len({s[1] for s in sender.sent[10:51]}) == 1  # idle: the cached silence packet
    track.stop()
    with pytest.raises(MediaStreamError):
        await parked  # stop releases aiortc's task
    count = len(sender.sent)
    await asyncio.sleep(0.1)
    assert len(sender.sent) == count  # and the timer is gone
    assert track._direct_timer is None and buffer.on_arrival is None


async def test_speech_marks_fire_after_their_packet_left_and_onset_rephases() -> None:
    buffer = PlayoutBuffer(100)
    sender = RecordingSender()
    track = direct_track(buffer, sender)
    parked = asyncio.ensure_future(track.recv())
    await until(lambda: len(sender.sent) >= 8)  # idle for a while
    await asyncio.sleep(0.007)  # between two ticks
    sent_at_mark: list[int] = []
    put_at = time.monotonic()

    def mark() -> None:
        sent_at_mark.append(len(sender.sent))

    for i in range(5):
        await buffer.put(tone_frame(i), (mark,))
    await until(lambda: len(sent_at_mark) == 5)
    first_speech = next(i for i, s in enumerate(sender.sent) if len(s[1]) > 40)
    # Sent as it arrived, not at the next tick (up to 20 ms later).
    assert sender.sent[first_speech][0] - put_at < 0.010  # the next tick was ~13 ms away
    assert track.stats.early_rephases == 1
    # Each frame's marks ran right after its own packet went out.
    assert sent_at_mark == [first_speech + 1 + i for i in range(5)]
    pts = [s[2] for s in sender.sent]
    assert np.all(np.diff(pts) == FRAME_SAMPLES)
    # After the re-phased onset the clock runs on from it at 20 ms: a late timer can only
    # delay a packet, nothing may go out early (a second timer chain would).
    onset = sender.sent[first_speech][0]
    for i in range(1, 5):
        assert sender.sent[first_speech + i][0] - onset > i * 0.020 - 0.002, i
    track.stop()
    with pytest.raises(MediaStreamError):
        await parked
    assert buffer.on_arrival is None and track._direct_timer is None


async def test_a_stalled_loop_moves_the_clock_instead_of_bursting() -> None:
    buffer = PlayoutBuffer(500)
    sender = RecordingSender()
    track = direct_track(buffer, sender)
    for i in range(300):
        await buffer.put(tone_frame(i))
    parked = asyncio.ensure_future(track.recv())
    await until(lambda: len(sender.sent) >= 5)
    start = track._start
    assert start is not None
    time.sleep(0.25)  # the event loop is blocked
    before = len(sender.sent)
    await until(lambda: len(sender.sent) >= before + 10)
    stamps = [s[0] for s in sender.sent[before : before + 10]]
    assert int((np.diff(stamps) < 0.005).sum()) <= 1  # no catch-up burst
    assert track.stats.late_rephases >= 1
    # The clock moved by whole frames: the track keeps its phase (tracks that one stall
    # delayed do not all end up due at the same instant of every tick).
    moved = (track._start - start) / FRAME_SECONDS
    assert moved >= 9 and abs(moved - round(moved)) < 1e-6, moved
    track.stop()
    with pytest.raises(MediaStreamError):
        await parked


async def test_a_failing_send_loses_one_packet_and_the_clock_goes_on() -> None:
    buffer = PlayoutBuffer(100)
    sender = RecordingSender(fail_sends={3, 4})
    track = direct_track(buffer, sender)
    parked = asyncio.ensure_future(track.recv())
    await until(lambda: len(sender.sent) >= 10)
    assert track.stats.direct_errors == 2
    pts = [s[2] for s in sender.sent]
    assert pts[:4] == [0, 960, 1920, 4800]  # the packets of ticks 3 and 4 were lost
    assert np.all(np.diff(pts[3:]) == FRAME_SAMPLES)  # and the clock kept its 20 ms steps
    track.stop()
    with pytest.raises(MediaStreamError):
        await parked


async def test_a_direct_path_not_ready_at_the_first_packet_is_given_up() -> None:
    """Switching paths mid-stream would restart sequence numbers and timestamps: the first
    packet decides (aiortc asks for it once DTLS is up, when the lean path resolves)."""
    buffer = PlayoutBuffer(100)
    sender = RecordingSender(ready_after=1)
    track = direct_track(buffer, sender)
    packets = [await track.recv() for _ in range(4)]
    assert [p.pts for p in packets] == [0, 960, 1920, 2880]
    assert sender.resolves == 1 and not sender.sent and not track.direct
    track.stop()


async def test_an_unusable_direct_sender_leaves_the_track_on_aiortc_path() -> None:
    buffer = PlayoutBuffer(100)
    sender = RecordingSender(usable=False)
    track = direct_track(buffer, sender)
    packets = [await track.recv() for _ in range(3)]
    assert [p.pts for p in packets] == [0, 960, 1920] and not sender.sent
    assert not track.direct
    track.stop()


async def test_encoding_ahead_on_the_lean_path_gives_the_same_packets() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        streams = []
        for executor in (None, pool):
            buffer = PlayoutBuffer(100)
            sender = RecordingSender()
            track = direct_track(buffer, sender, rephase_on_onset=False, encode_executor=executor)
            for i in range(30):
                await buffer.put(tone_frame(i))
            parked = asyncio.ensure_future(track.recv())
            await until(lambda sender=sender: len(sender.sent) >= 35)  # type: ignore[misc]
            track.stop()
            with pytest.raises(MediaStreamError):
                await parked
            streams.append([payload for _, payload, _ in sender.sent[:35]])
    inline, ahead = streams
    assert inline == ahead
    assert all(len(p) > 40 for p in ahead[:30])  # the 30 speech frames come first


async def test_a_failing_encode_loses_one_packet_and_the_clock_goes_on() -> None:
    buffer = PlayoutBuffer(100)
    sender = RecordingSender()
    track = direct_track(buffer, sender, rephase_on_onset=False)
    marked: list[int] = []
    for i in range(20):
        await buffer.put(tone_frame(i), (lambda i=i: marked.append(i),))
    fail_third_encode(track)
    parked = asyncio.ensure_future(track.recv())
    await until(lambda: len(sender.sent) >= 10)
    assert track.stats.direct_errors == 1
    pts = [s[2] for s in sender.sent]
    assert pts[:3] == [0, 960, 2880]  # the third packet was lost, the clock went on
    assert marked[:5] == [0, 1, 2, 3, 4]  # its frame's events still fired (speech.ended...)
    assert not parked.done() and track.readyState == "live"
    track.stop()
    with pytest.raises(MediaStreamError):
        await parked


def _put_now(buffer: PlayoutBuffer, pcm: object) -> None:
    """buffer.put on a buffer with room never suspends: run it to its end, synchronously."""
    coro = buffer.put(pcm)  # type: ignore[arg-type]
    with pytest.raises(StopIteration):
        coro.send(None)


def test_an_onset_that_arrives_after_a_stall_re_phases_like_any_late_tick() -> None:
    """Fake clock. A tick more than ``max_late_s`` late moves the clock (no catch-up burst);
    it did not when a frame's arrival started the late tick: then every missed tick fell due
    at once (found by review)."""
    for arrived in (False, True):
        buffer = PlayoutBuffer(100)
        track = OpusPacketTrack(buffer)  # default max_late_s=0.06
        track._start = 100.0
        track._pts = 10 * 960 - 960  # the next packet is due at 100.2
        buffer._frames.append((tone_frame(0), ()))
        now = 100.2 + 0.070  # the loop stalled: 70 ms late, more than max_late_s
        track._advance(now, arrived)
        next_due = track._start + (track._pts + 960) / 48_000
        # Whatever woke the tick, the next packet must not already be overdue by more than
        # max_late_s (a burst of back-to-back packets follows otherwise).
        assert next_due - now > -FRAME_SECONDS, (arrived, next_due - now)
        track.stop()


async def test_speech_onset_after_a_producer_stall_is_not_sent_as_a_burst() -> None:
    """Real loop, lean send path. The track is idle (silence); the speech producer blocks the
    loop ~85 ms (a synchronous engine call, a normalizer, a GC) and then puts its first frames.
    The onset goes out at once (the arrival wakes the track) ~65 ms after its tick was due,
    and the clock was not moved: the following speech packets were all overdue and went out
    back to back (3-4 packets, 80 ms of audio, in one burst) instead of on a 20 ms grid."""
    loop = asyncio.get_running_loop()
    buffer = PlayoutBuffer(500)
    stalled: list[float] = []

    def producer() -> None:
        time.sleep(0.085)  # blocks the loop just after a tick
        stalled.append(time.monotonic())
        for i in range(50):
            _put_now(buffer, tone_frame(i))

    class Sender(RecordingSender):
        def send(self, payload: bytes, pts: int) -> None:
            super().send(payload, pts)
            if len(self.sent) == 10:
                loop.call_soon(producer)  # right after this tick's send

    sender = Sender()
    track = direct_track(buffer, sender)
    parked = asyncio.ensure_future(track.recv())
    await until(lambda: len(sender.sent) >= 20)
    track.stop()
    with pytest.raises(MediaStreamError):
        await parked
    first = next(i for i, s in enumerate(sender.sent) if len(s[1]) > 40)
    stamps = [s[0] for s in sender.sent[first : first + 6]]
    gaps = [round((b - a) * 1000, 1) for a, b in itertools.pairwise(stamps)]
    back_to_back = sum(1 for g in gaps if g < 5.0)
    # After a stall the clock moves instead of bursting: at most the one packet that is due
    # within the next frame may follow at once.
    assert back_to_back <= 1, (gaps, track.stats.late_rephases)
