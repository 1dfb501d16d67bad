"""Resampling to the encoder's input rate and cutting into 20 ms int16 frames (agent/audio.py)."""

from __future__ import annotations

import numpy as np

from agent.audio import Framer, StreamResampler, to_int16
from agent.opus import FRAME_SAMPLES


def test_frames_are_the_stream_cut_at_960_whatever_the_chunk_sizes() -> None:
    rng = np.random.default_rng(3)
    stream = rng.uniform(-1.2, 1.2, 48_000).astype(np.float32)  # some beyond full scale
    framer = Framer(FRAME_SAMPLES)
    frames: list[np.ndarray] = []
    position = 0
    sizes = [1, 959, 960, 961, 2400, 7, 10_000, 3_333, 0]
    for size in [*sizes, len(stream) - sum(sizes)]:
        frames += framer.push(stream[position : position + size])
        position += size
    frames += framer.flush()
    assert position == len(stream) and len(frames) == len(stream) // FRAME_SAMPLES
    assert all(f.dtype == np.int16 and f.shape == (FRAME_SAMPLES,) for f in frames)
    assert np.array_equal(np.concatenate(frames), to_int16(stream))
    assert to_int16(np.array([1.5, -1.5], np.float32)).tolist() == [32767, -32767]  # clipped


def test_flush_pads_the_remainder_with_silence() -> None:
    framer = Framer(FRAME_SAMPLES)
    assert framer.push(np.full(1000, 0.5, np.float32))[0].shape == (FRAME_SAMPLES,)
    (last,) = framer.flush()
    assert (last[:40] == to_int16(np.float32(0.5))).all() and (last[40:] == 0).all()
    assert framer.flush() == []


def test_resampling_keeps_the_tone_and_the_length() -> None:
    rate = 24_000
    t = np.arange(rate) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    resampler = StreamResampler(rate, 48_000)
    out = np.concatenate(
        [resampler.process(tone[i : i + 2400]) for i in range(0, rate, 2400)] + [resampler.flush()]
    )
    assert abs(len(out) - 48_000) <= 1
    spectrum = np.abs(np.fft.rfft(out * np.hanning(len(out))))
    assert abs(np.fft.rfftfreq(len(out), 1 / 48_000)[np.argmax(spectrum)] - 440) < 2
    passthrough = StreamResampler(48_000, 48_000)
    assert passthrough.process(tone) is not None and np.array_equal(passthrough.process(tone), tone)
