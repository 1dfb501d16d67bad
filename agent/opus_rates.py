"""Opus's clock and the rates libopus encodes from: constants, no dependencies.

Kept apart from agent/opus.py (ctypes, PyAV) so that the configuration can check a rate
without loading the codec.
"""

from __future__ import annotations

SAMPLE_RATE = 48_000  # Opus's RTP clock and decoder rate, whatever the encoder's input rate
FRAME_SAMPLES = 960  # 20 ms at 48 kHz: the RTP timestamp step of every packet the track sends
FRAMES_PER_SECOND = SAMPLE_RATE // FRAME_SAMPLES
# The rates libopus encodes from (RFC 6716 section 2.1.1). The packets are the same Opus
# packets whatever the input rate; a lower one just caps the coded band at half of it.
INPUT_RATES = (8_000, 12_000, 16_000, 24_000, 48_000)
# The bitrates libopus takes (bits/s, OPUS_SET_BITRATE); the encoder clamps to them, the
# configuration refuses a setting outside them.
MIN_BITRATE = 6_000
MAX_BITRATE = 510_000


def input_rate_for(source_rate: int) -> int:
    """The lowest rate libopus encodes from that keeps all of a ``source_rate`` signal (up to
    48 kHz, the highest it takes).

    A 24 kHz engine (ChatTTS) is then encoded as it comes, with no resampling: measured with
    libopus 1.6 at 32 kbps, 3-12% less encoder time than the same speech upsampled to 48 kHz,
    at the same PESQ (bench/README, "Encoding at the engine's rate").
    """
    if source_rate <= 0:
        raise ValueError(f"an engine's sample rate must be positive, got {source_rate}")
    return next((rate for rate in INPUT_RATES if rate >= source_rate), SAMPLE_RATE)


def frame_samples(rate: int) -> int:
    """Samples in one 20 ms frame at ``rate``."""
    return rate // FRAMES_PER_SECOND
