"""A microphone for the Python client: paced 20 ms frames of silence, or of a clip when told.

It records when each frame of the clip left (``recv`` returned it to aiortc's sender, which
encodes and sends it at once), so tests and benches can time things from the moment the
clip's speech went into the uplink.
"""

from __future__ import annotations

import asyncio
import fractions
import time

import av
import numpy as np
import soxr
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

RATE = 48_000
FRAME = 960
TIME_BASE = fractions.Fraction(1, RATE)


class ClipMic(MediaStreamTrack):
    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._start: float | None = None
        self._pts = 0
        self._clip: np.ndarray | None = None
        self._pos = 0
        self.clip_frame_times: list[float] = []  # time.monotonic() each clip frame left
        self.done = asyncio.Event()

    def play(self, samples: np.ndarray, rate: int) -> None:
        """Send ``samples`` (mono float) from the next frame on, then silence again."""
        clip = samples if rate == RATE else soxr.resample(samples, rate, RATE)
        self._clip = np.asarray(clip, dtype=np.float32)
        self._pos = 0
        self.clip_frame_times = []
        self.done.clear()

    def sent_at(self, seconds_into_clip: float) -> float:
        """When the frame holding that instant of the last clip left."""
        index = int(seconds_into_clip * RATE) // FRAME
        return self.clip_frame_times[index]

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        else:
            self._pts += FRAME
        wait = self._start + self._pts / RATE - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        pcm = np.zeros(FRAME, dtype=np.float32)
        if self._clip is not None:
            chunk = self._clip[self._pos : self._pos + FRAME]
            pcm[: chunk.size] = chunk
            self._pos += FRAME
            self.clip_frame_times.append(time.monotonic())
            if self._pos >= self._clip.size:
                self._clip = None
                self.done.set()
        frame = av.AudioFrame.from_ndarray(
            (np.clip(pcm, -1, 1) * 32767).astype(np.int16).reshape(1, -1),
            format="s16",
            layout="mono",
        )
        frame.sample_rate = RATE
        frame.pts = self._pts
        frame.time_base = TIME_BASE
        return frame
