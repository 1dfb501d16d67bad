"""The playout buffer on its own: order, marks, peek, and what it costs the garbage collector."""

from __future__ import annotations

import gc

import numpy as np

from agent.playout import PlayoutBuffer


def frame(value: int) -> np.ndarray:
    return np.full(960, value, dtype=np.int16)


async def test_frames_and_their_marks_come_out_in_order() -> None:
    buffer = PlayoutBuffer(capacity_frames=10)
    fired: list[str] = []
    await buffer.put(frame(1), (lambda: fired.append("first"),))
    await buffer.put(frame(2))
    buffer.at_playout_end(lambda: fired.append("end"))
    buffer.at_playout_end(lambda: fired.append("end2"))
    peeked = buffer.peek()
    first = buffer.pop()
    assert peeked is not None and first is not None
    assert peeked.pcm is first.pcm  # what the track encodes ahead is what it then sends
    assert int(first.pcm[0]) == 1
    for mark in first.marks:
        mark()
    assert fired == ["first"]
    second = buffer.pop()
    assert second is not None and int(second.pcm[0]) == 2
    for mark in second.marks:
        mark()
    assert fired == ["first", "end", "end2"]
    assert buffer.pop() is None


async def test_at_playout_end_on_an_empty_buffer_fires_at_once() -> None:
    buffer = PlayoutBuffer(capacity_frames=2)
    fired: list[int] = []
    buffer.at_playout_end(lambda: fired.append(1))
    assert fired == [1]


async def test_buffered_audio_is_not_tracked_by_the_collector() -> None:
    # Seconds of audio wait in each session's buffer; objects the collector tracks that
    # live that long are promoted to its oldest generation and trigger full collections
    # (40-48 ms stalls of every track at 100 sessions). A frame without marks must leave
    # nothing for it to track once it has looked at it once.
    buffer = PlayoutBuffer(capacity_frames=1000)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(500):
        await buffer.put(frame(i))
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert len(buffer) == 500
    assert grown < 25, f"{grown} more tracked objects for 500 buffered frames"
