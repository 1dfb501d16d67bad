"""The bounded buffer between speech generation and the paced Opus track.

Generation runs ahead of playout by at most ``capacity`` frames; ``put`` waits beyond that,
which in turn stops the engine (backpressure all the way up). The track pops one frame per
20 ms tick and never waits on it: an empty buffer means silence.

Frames carry *marks*: callbacks fired when the frame is sent, so events such as
``speech.started`` are timed to what the listener hears, not to what was generated.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from agent.audio import Int16Frame
from agent.opus_rates import SAMPLE_RATE

Mark = Callable[[], None]


class PlayoutFrame(NamedTuple):
    pcm: Int16Frame
    marks: tuple[Mark, ...] = ()


# How a frame waits in the buffer: a plain tuple, not a PlayoutFrame. The collector stops
# tracking a plain tuple of untracked objects (an ndarray and the empty tuple) at its first
# pass; any class instance it tracks for life. The seconds of audio a session buffers ahead
# outlive two young collections, so as tracked objects they were promoted to the oldest
# generation by the thousand (measured: 30,000 of 80,000 tracked objects at N=100) and made
# it run a full collection, a 40-48 ms stall of every track, every 15 s or so.
_Stored = tuple[Int16Frame, tuple[Mark, ...]]


class PlayoutBuffer:
    def __init__(self, capacity_frames: int, sample_rate: int = SAMPLE_RATE) -> None:
        """``sample_rate``: the frames' rate, which the track's encoder is created for."""
        if capacity_frames < 1:
            raise ValueError("capacity must be at least one frame")
        self.capacity = capacity_frames
        self.sample_rate = sample_rate
        self._frames: deque[_Stored] = deque()
        self._space = asyncio.Event()
        self._space.set()
        # Called when a frame lands in an empty buffer: lets an idle track send speech
        # onset at once instead of at its next tick (one consumer per buffer).
        self.on_arrival: Callable[[], None] | None = None
        # True while an utterance is being produced: an empty buffer then is an underrun.
        self.producing = False
        self.underruns = 0
        self.last_arrival = 0.0  # time.monotonic() of the last put into an empty buffer

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def buffered_seconds(self) -> float:
        return len(self._frames) * 0.02

    def at_playout_end(self, mark: Mark) -> None:
        """Fire ``mark`` when everything buffered now has been sent (at once if empty)."""
        if self._frames:
            pcm, marks = self._frames[-1]
            self._frames[-1] = (pcm, (*marks, mark))
        else:
            mark()

    async def put(self, pcm: Int16Frame, marks: tuple[Mark, ...] = ()) -> None:
        """Queue one frame, and the marks to fire when it is sent; waits while full.

        ``pcm`` is the buffer's from now on: a new array per frame, never changed after (the
        track tells the frame it encoded ahead from the one it pops by this array)."""
        while len(self._frames) >= self.capacity:
            self._space.clear()
            await self._space.wait()
        was_empty = not self._frames
        self._frames.append((pcm, marks))
        if was_empty:
            self.last_arrival = time.monotonic()
            if self.on_arrival is not None:
                self.on_arrival()

    def peek(self) -> PlayoutFrame | None:
        """The frame the next ``pop`` would return, left in place (for encoding ahead).

        A new PlayoutFrame each call: tell frames apart by their ``pcm`` (the same array)."""
        return PlayoutFrame(*self._frames[0]) if self._frames else None

    def pop(self) -> PlayoutFrame | None:
        if not self._frames:
            if self.producing:
                self.underruns += 1
            return None
        pcm, marks = self._frames.popleft()
        if len(self._frames) < self.capacity:
            self._space.set()
        return PlayoutFrame(pcm, marks)

    def clear(self) -> int:
        """Drop everything (interrupt): marks of dropped frames never fire."""
        dropped = len(self._frames)
        self._frames.clear()
        self._space.set()
        return dropped
