"""Playout buffer behaviour the other tests left unguarded (found by mutation testing)."""

from __future__ import annotations

import asyncio

import numpy as np

from agent.playout import PlayoutBuffer


def frame(value: int) -> np.ndarray:
    return np.full(960, value, dtype=np.int16)


async def test_clear_wakes_a_producer_waiting_on_a_full_buffer() -> None:
    buffer = PlayoutBuffer(capacity_frames=2)
    await buffer.put(frame(1))
    await buffer.put(frame(2))
    blocked = asyncio.ensure_future(buffer.put(frame(3)))
    await asyncio.sleep(0.01)
    assert not blocked.done()  # backpressure: full
    assert buffer.clear() == 2  # interrupt: both buffered frames dropped
    await asyncio.wait_for(blocked, 0.5)  # ... and the producer may go on at once
    popped = buffer.pop()
    assert popped is not None and int(popped.pcm[0]) == 3
    assert buffer.pop() is None


async def test_underruns_count_empty_ticks_only_while_an_utterance_is_produced() -> None:
    buffer = PlayoutBuffer(capacity_frames=4)
    assert buffer.pop() is None  # idle silence is not an underrun
    assert buffer.underruns == 0
    buffer.producing = True
    await buffer.put(frame(1))
    assert buffer.pop() is not None
    assert buffer.underruns == 0
    assert buffer.pop() is None  # generation fell behind playout
    assert buffer.pop() is None
    assert buffer.underruns == 2
    buffer.producing = False
    assert buffer.pop() is None
    assert buffer.underruns == 2
