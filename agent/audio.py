"""Resampling to the encoder's input rate and cutting into 20 ms frames."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import soxr

from agent.engine import PCM

Int16Frame = npt.NDArray[np.int16]


class StreamResampler:
    """Streaming resampler (soxr) from an engine's rate to ``output_rate``; a no-op when
    they are equal.

    One instance per utterance: soxr keeps filter state across chunks, so chunk seams are
    continuous, and ``flush`` returns the tail the filter was still holding.
    """

    def __init__(self, input_rate: int, output_rate: int) -> None:
        self._passthrough = input_rate == output_rate
        self._stream = (
            None
            if self._passthrough
            else soxr.ResampleStream(input_rate, output_rate, 1, dtype="float32", quality="HQ")
        )

    def process(self, chunk: PCM) -> PCM:
        samples = np.asarray(chunk, dtype=np.float32).reshape(-1)
        if not np.isfinite(samples).all():
            # An engine's NaN or inf (a vocoder's fp16 overflow): the filter spread one such
            # sample over a whole block, cast to 37-75 ms of digital silence mid-word (found
            # by review). Out of range becomes full scale, as to_int16 clips it.
            samples = np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0)
        if self._stream is None:
            return samples
        out: PCM = self._stream.resample_chunk(samples)
        return out

    def flush(self) -> PCM:
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        out: PCM = self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        return out


def to_int16(samples: PCM) -> Int16Frame:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


class Framer:
    """Collects float samples and hands out complete 20 ms int16 frames."""

    def __init__(self, frame_samples: int) -> None:
        self._frame = frame_samples
        self._pending = np.zeros(0, dtype=np.float32)

    def push(self, samples: PCM) -> list[Int16Frame]:
        data = np.concatenate((self._pending, samples)) if len(self._pending) else samples
        whole = len(data) // self._frame * self._frame
        # One conversion for the whole chunk (per-frame numpy calls cost more than the
        # arithmetic); the frames are rows of it.
        frames = list(to_int16(data[:whole]).reshape(-1, self._frame)) if whole else []
        self._pending = np.array(data[whole:], dtype=np.float32)
        return frames

    def flush(self) -> list[Int16Frame]:
        """The remainder padded with silence to a whole frame (nothing if empty)."""
        if not len(self._pending):
            return []
        padded = np.zeros(self._frame, dtype=np.float32)
        padded[: len(self._pending)] = self._pending
        self._pending = np.zeros(0, dtype=np.float32)
        return [to_int16(padded)]
