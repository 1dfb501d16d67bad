"""Fan-out behaviour the other tests left unguarded (found by mutation testing)."""

from __future__ import annotations

from typing import cast

from agent.bitrate import EncoderTarget
from agent.direct import DirectSender
from agent.fanout import FanoutSource, FanoutTrack, SharedEncoderControl, SubscriberWish
from agent.opus import FRAME_SAMPLES
from tests.test_track_direct import RecordingSender

T0 = 1000.0  # an arbitrary loop time
FRAME_S = 0.02


def direct_track(sender: RecordingSender) -> FanoutTrack:
    track = FanoutTrack()
    track.use_direct(cast(DirectSender, sender))
    return track


def sent_pts(sender: RecordingSender) -> list[int]:
    return [pts for _, _, pts in sender.sent]


async def test_subscribing_to_another_source_leaves_the_first() -> None:
    """A slot that changes speaker moves its track: it must not hear both sources."""
    first, second = FanoutSource("a", lambda t: None), FanoutSource("b", lambda t: None)
    track = FanoutTrack()
    first.subscribe(track)
    second.subscribe(track)
    assert (first.subscribers, second.subscribers, track.source) == (0, 1, second)
    first.publish(b"old speaker")
    second.publish(b"new speaker")
    assert bytes(await track.recv()) == b"new speaker"
    assert track.stats.packets == 1 and not track._queue


def test_a_subscriber_moving_to_another_source_withdraws_its_wish_from_the_first() -> None:
    applied: list[EncoderTarget] = []
    old, new = SharedEncoderControl(applied.append), SharedEncoderControl(lambda t: None)
    good = SubscriberWish(old, EncoderTarget(32_000, False, 0))
    good.set_bitrate(32_000)
    weak = SubscriberWish(old, EncoderTarget(32_000, False, 0))
    weak.set_bitrate(12_000)
    weak.set_fec(True)
    assert old.current == EncoderTarget(12_000, True, 0)
    weak.move_to(new)  # the weak listener's slot now carries another speaker
    assert old.current == EncoderTarget(32_000, False, 0)  # the old source climbs back
    assert applied[-1] == EncoderTarget(32_000, False, 0)
    assert new.current == EncoderTarget(12_000, True, 0)


def test_repeated_stalls_keep_the_timestamps_continuous() -> None:
    """Each stall moves the subscriber's clock: stalls must not add up to a false pause
    (a timestamp jump in the middle of continuous audio)."""
    sender = RecordingSender()
    track = direct_track(sender)
    now = T0
    for _stall in range(5):
        for _ in range(5):
            track.push(b"x", now)
            now += FRAME_S
        now += 7 * FRAME_S  # the event loop stalled for 7 frames
    pts = sent_pts(sender)
    assert pts == [i * FRAME_SAMPLES for i in range(25)], pts


def test_a_pause_after_a_burst_is_measured_from_the_burst() -> None:
    """A source that bursts (a jitter buffer releasing frames) pulls the clock forward, so
    a pause right after it still shows as a timestamp jump of about the pause."""
    sender = RecordingSender()
    track = direct_track(sender)
    for _ in range(10):
        track.push(b"burst", T0)  # ten packets at once
    track.push(b"after", T0 + 30 * FRAME_S)  # then 30 frames (600 ms) of nothing
    pts = sent_pts(sender)
    assert pts[:10] == [i * FRAME_SAMPLES for i in range(10)]
    jump = pts[10] - pts[9]
    assert jump % FRAME_SAMPLES == 0 and 25 * FRAME_SAMPLES <= jump <= 32 * FRAME_SAMPLES, jump


async def test_one_subscribers_failing_send_does_not_reach_the_others() -> None:
    source = FanoutSource("s", lambda t: None)
    broken, fine = RecordingSender(fail_sends={0}), RecordingSender()
    first, second = direct_track(broken), direct_track(fine)
    source.subscribe(first)
    source.subscribe(second)
    source.publish(b"one")  # the first subscriber's socket raises
    source.publish(b"two")
    assert [payload for _, payload, _ in fine.sent] == [b"one", b"two"]
    assert [payload for _, payload, _ in broken.sent] == [b"two"]
    assert (first.dropped, second.dropped) == (1, 0)


def test_a_withdrawn_or_closed_wish_stays_out_of_the_encoders_policy() -> None:
    """An empty slot's wish is withdrawn (no encoder to steer), but its controller kept
    running, and its next change re-entered the wish into the control it last named, the
    room agent's; a departed member's wish did the same when RTCP arrived between leaving
    and the connection's close, pinning the agent's bitrate to a listener long gone (found
    by review). Withdrawn, a wish counts again only once it moves to a source; closed,
    never."""
    applied: list[EncoderTarget] = []
    agent = SharedEncoderControl(applied.append)
    speaker = SharedEncoderControl(lambda target: None)
    listener = SubscriberWish(agent, EncoderTarget(32_000, False, 0))
    listener.set_bitrate(24_000)
    empty_slot = SubscriberWish(agent, EncoderTarget(32_000, False, 0))
    empty_slot.withdraw()
    empty_slot.set_bitrate(8_000)  # its controller's next change
    assert agent.current == EncoderTarget(24_000, False, 0), agent.current
    empty_slot.move_to(speaker)  # a speaker takes the slot: the wish steers that encoder
    assert speaker.current == EncoderTarget(8_000, False, 0)
    listener.close()  # the member left ...
    listener.set_bitrate(6_000)  # ... and RTCP still came in before its connection closed
    listener.move_to(speaker)
    assert agent._wishes == {} and list(speaker._wishes) == [empty_slot]
    assert agent.current == EncoderTarget(24_000, False, 0)  # kept for the next subscriber
