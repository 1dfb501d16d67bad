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
