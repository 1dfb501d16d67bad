"""The ctypes libopus encoder: real packets, decodable by FFmpeg's decoder, settings live."""

from __future__ import annotations

import ctypes

import av
import numpy as np
import pytest
import soxr

from agent.opus import FRAME_SAMPLES, OpusEncoder, OpusError
from agent.opus_rates import input_rate_for


def speech_like(seconds: float, seed: int = 0, rate: int = 48_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    voiced = np.sin(2 * np.pi * 180 * t) + 0.5 * np.sin(2 * np.pi * 360 * t + 1)
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)
    x = 0.3 * voiced * envelope + 0.02 * rng.standard_normal(t.size)
    return (np.clip(x, -1, 1) * 32767).astype(np.int16)


def encode_all(encoder: OpusEncoder, pcm: np.ndarray) -> list[bytes]:
    size = encoder.frame_samples
    return [encoder.encode(f) for f in pcm[: len(pcm) // size * size].reshape(-1, size)]


def decode_all(packets: list[bytes]) -> np.ndarray:
    """Decode with FFmpeg's libopus decoder (what aiortc's receiver uses) to mono float."""
    codec = av.CodecContext.create("libopus", "r")
    codec.sample_rate = 48_000
    to_mono = av.AudioResampler(format="s16", layout="mono", rate=48_000)
    out = []
    for i, payload in enumerate(packets):
        packet = av.Packet(payload)
        packet.pts = i * FRAME_SAMPLES
        for frame in codec.decode(packet):
            out.extend(f.to_ndarray().reshape(-1) for f in to_mono.resample(frame))
    return np.concatenate(out).astype(np.float32) / 32768.0


def test_round_trip_preserves_the_signal() -> None:
    pcm = speech_like(1.0)
    packets = encode_all(OpusEncoder(bitrate=32_000), pcm)
    assert_decodes_to(packets, pcm.astype(np.float32) / 32768.0)


def assert_decodes_to(packets: list[bytes], reference: np.ndarray) -> None:
    """``packets`` decode (at 48 kHz) to ``reference`` (48 kHz float), give or take a codec."""
    decoded = decode_all(packets)
    # Opus has a 6.5 ms algorithmic delay; align by cross-correlation, then compare.
    lag = int(np.argmax(np.correlate(decoded[:4800], reference[:2400], mode="valid")))
    aligned = decoded[lag : lag + len(reference) - 960]
    ref = reference[: len(aligned)]
    # A perceptual codec keeps the waveform only roughly: compare correlation and level.
    correlation = float(np.corrcoef(ref, aligned)[0, 1])
    assert correlation > 0.85, correlation
    level = float(np.sqrt(np.mean(aligned**2)) / np.sqrt(np.mean(ref**2)))
    assert 0.85 < level < 1.15, level


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (8_000, 8_000),
        (11_025, 12_000),
        (16_000, 16_000),
        (22_050, 24_000),
        (24_000, 24_000),
        (32_000, 48_000),
        (44_100, 48_000),
        (96_000, 48_000),
    ],
)
def test_the_input_rate_is_the_lowest_libopus_takes_that_keeps_the_source(
    source: int, expected: int
) -> None:
    assert input_rate_for(source) == expected


def test_an_engine_without_a_rate_is_an_error_not_narrowband() -> None:
    for rate in (0, -24_000):
        with pytest.raises(ValueError, match="positive"):
            input_rate_for(rate)


def test_an_encoder_fed_at_24khz_sends_the_same_signal_coded_up_to_super_wideband() -> None:
    """ChatTTS's rate, encoded as generated: 10 ms of samples a frame fewer, the packets still
    decode at 48 kHz to the signal, and the band stops at 12 kHz (all a 24 kHz source has)."""
    encoder = OpusEncoder(bitrate=32_000, sample_rate=24_000)
    assert (encoder.sample_rate, encoder.frame_samples) == (24_000, 480)
    with pytest.raises(ValueError, match="480"):
        encoder.encode(np.zeros(FRAME_SAMPLES, np.int16))
    pcm = speech_like(1.0, rate=24_000)  # its noise floor reaches 12 kHz
    packets = encode_all(encoder, pcm)
    assert len(packets) == 50
    assert coded_bands(packets) == {"swb"}
    # The same signal fed at 48 kHz is coded full band: the input rate made the difference.
    assert "fb" in coded_bands(encode_all(OpusEncoder(bitrate=32_000), speech_like(1.0)))
    reference = soxr.resample(pcm.astype(np.float32) / 32768.0, 24_000, 48_000)
    assert_decodes_to(packets, reference.astype(np.float32))
    for rate in (22_050, 44_100, 0):
        with pytest.raises(ValueError, match="libopus encodes from"):
            OpusEncoder(sample_rate=rate)


def test_bitrate_changes_take_effect_mid_stream() -> None:
    encoder = OpusEncoder(bitrate=64_000)
    pcm = speech_like(3.0)
    high = encode_all(encoder, pcm[:48_000])
    encoder.set_bitrate(12_000)
    low = encode_all(encoder, pcm[48_000:96_000])
    encoder.set_bitrate(32_000)
    mid = encode_all(encoder, pcm[96_000:])
    rate = [sum(map(len, p[10:])) * 8 / (len(p[10:]) * 0.02) for p in (high, low, mid)]
    assert rate[0] > 45_000 and rate[1] < 16_000 and 22_000 < rate[2] < 40_000, rate
    assert encoder.bitrate == 32_000


def test_fec_dtx_loss_settings() -> None:
    encoder = OpusEncoder(bitrate=24_000)
    pcm = speech_like(1.0)
    plain = sum(map(len, encode_all(encoder, pcm)))
    encoder.set_fec(True)
    encoder.set_expected_loss(20)
    with_fec = sum(map(len, encode_all(encoder, pcm)))
    assert encoder.fec and encoder.expected_loss_pct == 20
    assert with_fec != plain  # FEC redistributes bits for the redundant copy
    encoder.set_dtx(True)
    silent = [encoder.encode(np.zeros(FRAME_SAMPLES, np.int16)) for _ in range(30)]
    assert min(map(len, silent[-10:])) <= 2  # DTX: TOC-only packets once silence settles
    encoder.set_expected_loss(250)
    assert encoder.expected_loss_pct == 100
    encoder.set_bitrate(1)
    assert encoder.bitrate == 6_000


def test_bad_frames_and_closed_encoder() -> None:
    encoder = OpusEncoder()
    with pytest.raises(ValueError):
        encoder.encode(np.zeros(480, np.int16))
    with pytest.raises(ValueError):
        encoder.encode(np.zeros(FRAME_SAMPLES, np.float32))  # type: ignore[arg-type]
    encoder.close()
    with pytest.raises(OpusError):
        encoder.encode(np.zeros(FRAME_SAMPLES, np.int16))
    encoder.close()  # idempotent


def coded_bands(packets: list[bytes], settle: int = 10) -> set[str]:
    """The band each packet's TOC byte says it codes (RFC 6716 3.1), after ``settle``."""
    names = {range(0, 4): "nb", range(4, 8): "mb", range(8, 12): "wb", range(12, 14): "swb"}
    names |= {range(14, 16): "fb", range(16, 20): "nb", range(20, 24): "wb"}
    names |= {range(24, 28): "swb", range(28, 32): "fb"}
    return {
        next(name for span, name in names.items() if p[0] >> 3 in span) for p in packets[settle:]
    }


def test_the_band_cap_and_the_receivers_rate_limit_the_coded_band_together() -> None:
    pcm = speech_like(1.0)  # its noise floor reaches the top of the band
    encoder = OpusEncoder(bitrate=32_000)
    assert coded_bands(encode_all(encoder, pcm)) <= {"swb", "fb"}
    encoder.set_band_cap(16_000)  # the CPU governor's wide-band rungs: at once
    assert coded_bands(encode_all(encoder, pcm)) == {"wb"}
    # ... and its medium-band rung: SILK lowers its internal rate through a low-pass
    # transition (measured: 2.9 s from wide-band; at once from full band), and back within
    # 13 frames.
    encoder.set_band_cap(12_000)
    assert coded_bands(encode_all(encoder, speech_like(4.0)), settle=175) == {"mb"}
    encoder.set_band_cap(16_000)
    assert coded_bands(encode_all(encoder, pcm), settle=20) == {"wb"}
    # Full band again: libopus widens within 240 ms once SILK's own widening is over (4.6 s
    # after medium-band, measured), and the governor holds each rung 5 s before climbing.
    encode_all(encoder, speech_like(5.0))
    encoder.set_band_cap(None)
    assert coded_bands(encode_all(encoder, pcm), settle=20) <= {"swb", "fb"}
    assert encoder.band_cap is None
    # A receiver that plays 8 kHz: the narrower limit wins, and stays when the cap goes.
    narrow = OpusEncoder(bitrate=32_000)
    narrow.set_max_playback_rate(8_000)
    narrow.set_band_cap(16_000)
    assert coded_bands(encode_all(narrow, pcm)) == {"nb"}
    narrow.set_band_cap(None)
    assert coded_bands(encode_all(narrow, pcm)) == {"nb"}
    assert narrow.max_playback_rate == 8_000


def test_frames_are_encoded_from_any_layout_the_same() -> None:
    """The encoder copies each frame into its own buffer: strided views and read-only
    arrays (a cached silence frame) give the same packets as contiguous frames."""
    pcm = speech_like(0.5)
    frames = pcm[: len(pcm) // FRAME_SAMPLES * FRAME_SAMPLES].reshape(-1, FRAME_SAMPLES)
    strided = np.repeat(frames, 2, axis=1)[:, ::2]
    readonly = frames.copy()
    readonly.flags.writeable = False
    assert not strided[0].flags.c_contiguous
    for layout in (strided, readonly):
        encoder, reference = OpusEncoder(), OpusEncoder()
        assert [encoder.encode(f) for f in layout] == [reference.encode(f) for f in frames]


def syllables(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """Voiced speech-like sound with a gliding pitch, in syllables separated by digital
    silence long enough for DTX to kick in (~0.38 s): SILK, hybrid and mode changes."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    phase = 2 * np.pi * np.cumsum(140 + 60 * np.sin(2 * np.pi * 0.7 * t)) / rate
    voiced = np.sin(phase) + 0.4 * np.sin(2 * phase)
    envelope = np.clip(np.sin(2 * np.pi * 1.3 * t), 0, 1)
    x = 0.35 * voiced * envelope + 0.03 * rng.standard_normal(t.size) * (envelope > 0)
    return (np.clip(x, -1, 1) * 32767).astype(np.int16)


def encoder_state(encoder: OpusEncoder) -> bytes:
    """The whole native state, as ``snapshot`` copies it."""
    assert encoder._handle is not None
    return ctypes.string_at(encoder._handle, encoder._lib.opus_encoder_get_size(1))


# name: (FEC, expected loss %, DTX, band cap)
SETTINGS = {
    "plain": (False, 0, False, None),
    "fec": (True, 15, False, None),
    "dtx": (False, 0, True, None),
    "fec+dtx": (True, 5, True, None),
    "wb-cap": (False, 0, False, 16_000),
    "nb-cap": (False, 0, False, 8_000),
}


@pytest.mark.parametrize("complexity", range(11))
@pytest.mark.parametrize("rate", [48_000, 24_000], ids=["48k", "24k"])
def test_a_restored_encoder_codes_as_if_the_dropped_frame_never_came(
    rate: int, complexity: int
) -> None:
    """What encoding ahead relies on when an interrupt drops the frame a worker encoded
    (agent/track.py): ``restore`` leaves libopus's state byte for byte as an encoder's that
    never saw the frame, so every later packet is the same; a setting changed while the
    dropped frame was in flight is kept."""
    size = rate // 50
    pcm = syllables(2.4, rate, seed=complexity).reshape(-1, size)
    stray = syllables(0.2, rate, seed=99).reshape(-1, size)[3]
    drop = 20
    for name, (fec, loss, dtx, cap) in SETTINGS.items():
        kept, fresh = (
            OpusEncoder(
                complexity=complexity, fec=fec, expected_loss_pct=loss, dtx=dtx, sample_rate=rate
            )
            for _ in range(2)
        )
        for encoder in (kept, fresh):
            encoder.set_band_cap(cap)
        assert [kept.encode(f) for f in pcm[:drop]] == [fresh.encode(f) for f in pcm[:drop]]
        kept.snapshot()
        kept.encode(stray)  # encoded ahead, then dropped
        for encoder in (kept, fresh):  # the network controller, meanwhile
            encoder.set_bitrate(24_000)
        kept.restore()
        assert encoder_state(kept) == encoder_state(fresh), name
        after = [kept.encode(f) for f in pcm[drop:]], [fresh.encode(f) for f in pcm[drop:]]
        assert after[0] == after[1], name
        assert encoder_state(kept) == encoder_state(fresh), name
        assert kept.bitrate == 24_000


def test_without_the_restore_a_dropped_frame_changes_what_follows() -> None:
    """The check above can fail: libopus carries a frame into the next ones' coding."""
    pcm = syllables(1.0, 48_000).reshape(-1, FRAME_SAMPLES)
    kept, fresh = OpusEncoder(), OpusEncoder()
    for frame in pcm[:20]:
        kept.encode(frame)
        fresh.encode(frame)
    kept.encode(pcm[20])
    assert [kept.encode(f) for f in pcm[21:]] != [fresh.encode(f) for f in pcm[21:]]


def test_restore_needs_a_snapshot_and_an_open_encoder() -> None:
    encoder = OpusEncoder()
    with pytest.raises(OpusError, match="no snapshot"):
        encoder.restore()
    encoder.snapshot()
    encoder.restore()  # nothing encoded since: a no-op
    encoder.close()
    for call in (encoder.snapshot, encoder.restore):
        with pytest.raises(OpusError, match="closed"):
            call()
