"""Bounding how far a replica runs ahead of the listener, across Ray Serve's stream.

Ray Serve (2.60) streams a replica's generator through an unbounded queue: the generator runs
as fast as it can however slowly the caller reads (measured: 99 items produced in 1 s with one
read), and Serve exposes no flow control to the replica (Ray core's generator backpressure is
not among the actor options Serve accepts). The listener, though, consumes at exactly real
time: the media process plays out 20 ms frames by the clock and pulls from the engine only
while less than ``max_buffer_ahead_s`` is buffered. So the replica paces itself: it stops
pulling audio from its engine once the stream is ``lead_s`` ahead of real-time playout
(counted from its first chunk). The engine's own backpressure then parks the stream (no
compute) once ``max_buffered_s`` of audio is unread, so a stream's generation stays within
``lead_s + max_buffered_s`` (+ one chunk) of its playout.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Pacer:
    """How long to wait before pulling the next chunk of one stream."""

    def __init__(
        self, sample_rate: int, lead_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rate = sample_rate
        self._lead_s = lead_s
        self._clock = clock
        self._start: float | None = None
        self.samples = 0

    def sent(self, samples: int) -> float:
        """Record a chunk handed to the stream; returns the seconds to wait before the next."""
        now = self._clock()
        if self._start is None:
            self._start = now  # playout starts when the first chunk arrives
        self.samples += samples
        ahead = self.samples / self._rate - (now - self._start)
        return max(0.0, ahead - self._lead_s)
