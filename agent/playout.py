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
from dataclasses import dataclass, field

from agent.audio import Int16Frame

Mark = Callable[[], None]


@dataclass
class PlayoutFrame:
    pcm: Int16Frame
    marks: list[Mark] = field(default_factory=list)


class PlayoutBuffer:
    def __init__(self, capacity_frames: int) -> None:
        if capacity_frames < 1:
            raise ValueError("capacity must be at least one frame")
        self.capacity = capacity_frames
        self._frames: deque[PlayoutFrame] = deque()
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
            self._frames[-1].marks.append(mark)
        else:
            mark()

    async def put(self, frame: PlayoutFrame) -> None:
        while len(self._frames) >= self.capacity:
            self._space.clear()
            await self._space.wait()
        was_empty = not self._frames
        self._frames.append(frame)
        if was_empty:
            self.last_arrival = time.monotonic()
            if self.on_arrival is not None:
                self.on_arrival()

    def peek(self) -> PlayoutFrame | None:
        """The frame the next ``pop`` would return, left in place (for encoding ahead)."""
        return self._frames[0] if self._frames else None

    def pop(self) -> PlayoutFrame | None:
        if not self._frames:
            if self.producing:
                self.underruns += 1
            return None
        frame = self._frames.popleft()
        if len(self._frames) < self.capacity:
            self._space.set()
        return frame

    def clear(self) -> int:
        """Drop everything (interrupt): marks of dropped frames never fire."""
        dropped = len(self._frames)
        self._frames.clear()
        self._space.set()
        return dropped
