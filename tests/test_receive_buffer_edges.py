"""Receive buffer behaviour the other tests left unguarded (found by mutation testing)."""

from __future__ import annotations

import pytest

from agent.receive_buffer import PromptAudioBuffer
from tests.test_receive_buffer import feed, packet


@pytest.mark.parametrize("lost", [65535, 65536, 65537])
def test_a_packet_lost_at_the_sequence_wrap_is_skipped(lost: int) -> None:
    """Giving up a missing packet steps over the wrap like releasing one does: the
    microphone must not stop (or raise) because the lost packet was number 65535."""
    order = [seq for seq in range(65530, 65545) if seq != lost]
    buffer = PromptAudioBuffer()
    released = [frame for _, frame in feed(buffer, order)]
    assert released == order  # each released as it arrives, in order
    assert (buffer.given_up, buffer.dropped_late) == (1, 0)


def test_a_late_packet_at_the_wrap_is_dropped_with_reorder_wait() -> None:
    buffer = PromptAudioBuffer(reorder_wait=1)
    released = feed(buffer, [65534, 65536, 65537, 65535, 65538])
    # 65535 is given up once two later packets are held; arriving after that, it is dropped.
    assert [frame for _, frame in released] == [65534, None, 65536, None, 65537]
    assert (buffer.given_up, buffer.dropped_late, buffer.queued) == (1, 1, 1)


@pytest.mark.parametrize("reorder_wait", [0, 2])
def test_an_empty_payload_takes_its_place_but_releases_no_frame(reorder_wait: int) -> None:
    """An empty frame would reach libavcodec as the end of the stream (every later packet
    then fails to decode): it is skipped in place, neither lost nor released."""
    buffer = PromptAudioBuffer(reorder_wait=reorder_wait)
    empty = packet(3)
    empty._data = b""  # type: ignore[attr-defined]
    out = feed(buffer, [1, 2])
    assert buffer.add(empty) == (False, None)
    out += feed(buffer, [4, 5])
    assert [frame for _, frame in out] == [1, 2, 4, 5]
    assert (buffer.empty, buffer.given_up, buffer.dropped_late, buffer.queued) == (1, 0, 0, 0)


@pytest.mark.parametrize(("reorder_wait", "burst"), [(14, 2), (10, 8), (6, 12)])
def test_a_short_burst_with_reorder_wait_keeps_the_packets_already_held(
    reorder_wait: int, burst: int
) -> None:
    """With reorder_wait W, one loss leaves W packets queued for the rest of the call: a
    later burst of only 16 - W - 1 losses put the next arrival a whole buffer ahead of the
    next packet due, and the reset for "a long burst lost" threw the W packets away (280 ms
    of the user's audio at W=14, after losing two packets). A burst is measured from the
    newest packet held."""
    lost = {20} | set(range(100, 100 + burst))
    order = [seq for seq in range(300) if seq not in lost]
    buffer = PromptAudioBuffer(reorder_wait=reorder_wait)
    released = [frame for _, frame in feed(buffer, order) if frame is not None]
    assert [seq for seq in order if seq < 300 - reorder_wait - 1 and seq not in released] == []
    assert released == sorted(released)
    assert buffer.given_up == len(lost)


def feed_from(buffer: PromptAudioBuffer, ssrc: int, order: list[int]) -> list[int]:
    frames = [buffer.add(packet(seq, ssrc))[1] for seq in order]
    return [int.from_bytes(frame.data, "big") for frame in frames if frame is not None]


def test_a_sender_restarted_under_a_new_ssrc_is_heard_at_once() -> None:
    """A restarted sender starts a new sequence space at a random number; one that fell up
    to 100 behind the old stream's was taken for the old stream's late packets, and the
    user went unheard for up to 2 s. A new SSRC starts afresh; the old one's late packets
    are still dropped, and do not disturb the new stream."""
    buffer = PromptAudioBuffer()
    assert feed_from(buffer, 0x1111, list(range(1000, 1050))) == list(range(1000, 1050))
    assert feed_from(buffer, 0x2222, list(range(960, 980))) == list(range(960, 980))
    assert feed_from(buffer, 0x1111, [1050, 1051]) == []  # the replaced source, late
    assert feed_from(buffer, 0x2222, list(range(980, 1010))) == list(range(980, 1010))
    assert (buffer.given_up, buffer.dropped_late) == (0, 2)


def test_a_new_ssrc_gives_up_what_the_old_one_left_held() -> None:
    buffer = PromptAudioBuffer(reorder_wait=2)
    assert feed_from(buffer, 1, [1, 3, 4]) == [1]  # 2 missing: 3 and 4 wait for it
    assert feed_from(buffer, 2, [500, 501]) == [500, 501]
    assert (buffer.given_up, buffer.queued) == (2, 0)


def test_a_source_that_comes_back_after_another_is_heard_again() -> None:
    """A sender going from source A to B and back to A: A's packets were all dropped as
    late, for as long as A was on the replaced list (found by review). A's packets up to a
    buffer (16) past where it stopped are its stragglers; from there on, A is heard."""
    buffer = PromptAudioBuffer()
    assert feed_from(buffer, 0xA, list(range(100, 150))) == list(range(100, 150))
    assert feed_from(buffer, 0xB, list(range(7000, 7050))) == list(range(7000, 7050))
    assert feed_from(buffer, 0xA, [120]) == []  # from before A stopped: late
    assert feed_from(buffer, 0xA, list(range(150, 440))) == list(range(166, 440))
    assert feed_from(buffer, 0xB, [7049, 7050]) == []  # and now B's stragglers are late
    assert buffer.dropped_late == 1 + 16 + 2
