"""Audio clips for the listening tests and benches: recorded speech, and noise + music."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
# espeak-ng -s 160 "Hello there, please stop talking. What time is it?", resampled to
# 16 kHz mono, trimmed, peak 0.7 (112 KB).
SPEECH_WAV = DATA / "speech.wav"
SPEECH_TEXT = "Hello there, please stop talking. What time is it?"


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as wav:
        assert wav.getsampwidth() == 2 and wav.getnchannels() == 1, path
        pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
        return pcm.astype(np.float32) / 32768.0, wav.getframerate()


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())


def speech_onset(samples: np.ndarray, rate: int, threshold: float = 0.02) -> float:
    """Seconds into the clip where its first sound above ``threshold`` is."""
    loud = np.flatnonzero(np.abs(samples) > threshold)
    assert loud.size, "the clip is silent"
    return float(loud[0] / rate)


def noise_and_music(seconds: float, rate: int = 48_000, seed: int = 7) -> np.ndarray:
    """No speech: pink-ish noise, a chord progression with a melody, and a drum beat.

    What a microphone hears in a room with music on; a voice-activity detector must not
    take it for someone talking.
    """
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    white = rng.standard_normal(n)
    # Pink-ish: a few one-pole low-passes summed.
    pink = np.zeros(n)
    for alpha in (0.02, 0.1, 0.5):
        state = 0.0
        out = np.empty(n)
        a = alpha
        for i in range(0, n, 4800):  # blockwise cumulative filter, vectorized enough
            block = white[i : i + 4800]
            y = np.empty_like(block)
            for j, v in enumerate(block):
                state += a * (v - state)
                y[j] = state
            out[i : i + 4800] = y
        pink += out / np.std(out)
    noise = 0.04 * pink / 3
    chords = [(220.0, 277.2, 329.6), (196.0, 246.9, 293.7), (174.6, 220.0, 261.6)]
    music = np.zeros(n)
    beat = 0.5  # seconds per beat
    for k, start in enumerate(np.arange(0, seconds, 4 * beat)):
        idx = (t >= start) & (t < start + 4 * beat)
        for f in chords[k % len(chords)]:
            music[idx] += (
                0.05
                * np.sin(2 * np.pi * f * t[idx])
                * (1 + 0.3 * np.sin(2 * np.pi * 2 * f * t[idx]))
            )
    melody = [659.3, 587.3, 523.3, 587.3, 659.3, 784.0, 659.3, 523.3]
    for k, start in enumerate(np.arange(0, seconds, beat)):
        idx = (t >= start) & (t < start + beat)
        local = t[idx] - start
        env = np.exp(-3 * local)
        music[idx] += 0.08 * env * np.sin(2 * np.pi * melody[k % len(melody)] * local)
        # kick drum: a decaying low sine sweep
        kick = np.exp(-25 * local) * np.sin(2 * np.pi * (60 + 80 * np.exp(-30 * local)) * local)
        music[idx] += 0.3 * kick
        # hi-hat on the off-beat: short noise burst
        off = (local >= beat / 2) & (local < beat / 2 + 0.03)
        hits = np.flatnonzero(idx)[off]
        music[hits] += 0.05 * rng.standard_normal(hits.size)
    return (noise + music).astype(np.float32)
