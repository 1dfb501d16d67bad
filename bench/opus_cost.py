"""What libopus costs per 20 ms frame at each complexity, and what it sounds like.

The encode is most of a speaking session's server CPU (`bench/README.md`), so this is the
table behind ``--complexity`` and the CPU governor's rungs: for complexity 0-10, the
wide-band cap at 6, 2 and 0, the medium-band cap at 2, 1 and 0 (and a few modes not
adopted), encode time per frame
(``time.process_time``; every setting runs once per round, rounds interleaved, median
reported: this VM's steal makes single runs vary by +-30%) and, when the ``pesq`` and
``pystoi`` packages are importable, PESQ wide-band and STOI of the decoded speech against
the original (``tests/data/speech.wav``: espeak-ng, 16 kHz content; ``--wav`` another mono
16-bit clip, e.g. espeak-ng's own 22 kHz output, whose sibilants reach 11 kHz).
``--input-rates 48000,24000`` runs every setting at each encoder input rate too (the clip
resampled to it; ``OpusSettings.input_rate``: ChatTTS's 24 kHz is encoded as generated).

    .venv/bin/python bench/opus_cost.py              # cost only, or with quality if installed
    .venv/bin/pip install pesq pystoi && .venv/bin/python bench/opus_cost.py --bitrate 24000
    espeak-ng -v en-us+f3 -w /tmp/s.wav "She sells sea shells by the sea shore" \
        && .venv/bin/python bench/opus_cost.py --wav /tmp/s.wav --input-rates 48000,24000
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soxr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.governor import MEDIUM_BAND_HZ, WIDE_BAND_HZ
from agent.opus import OpusDecoder, OpusEncoder
from agent.opus_rates import INPUT_RATES, SAMPLE_RATE, frame_samples
from tests.clips import SPEECH_WAV, read_wav

# libopus's private opus_private.h request (not in the public API): force a coding mode.
_FORCE_MODE = 11002
_MODE_SILK_ONLY, _MODE_CELT_ONLY = 1000, 1002
_SET_MAX_BANDWIDTH, _WIDEBAND = 4004, 1103


def settings() -> dict[str, Callable[[OpusEncoder], None]]:
    table: dict[str, Callable[[OpusEncoder], None]] = {
        f"complexity {c}": (lambda e, c=c: e.set_complexity(c)) for c in range(11)
    }
    # The CPU governor's cheap rungs (agent/governor.py): the band capped at wide-band, and
    # at medium-band (its bottom rung; wide-band 0 was, until it measured worse).
    for name, hertz, complexities in (
        ("wide-band", WIDE_BAND_HZ, (6, 2, 0)),
        ("medium-band", MEDIUM_BAND_HZ, (2, 1, 0)),
    ):
        for c in complexities:
            table[f"{name} cap, c{c}"] = lambda e, c=c, hertz=hertz: (
                e.set_complexity(c),
                e.set_band_cap(hertz),
            )
    table["CELT only, c9"] = lambda e: e._ctl(_FORCE_MODE, _MODE_CELT_ONLY)
    table["SILK only wide-band, c9"] = lambda e: (
        e._ctl(_FORCE_MODE, _MODE_SILK_ONLY),
        e._ctl(_SET_MAX_BANDWIDTH, _WIDEBAND),
    )
    return table


def speech_frames(speech: np.ndarray, rate: int, input_rate: int) -> np.ndarray:
    """``speech`` at ``rate`` as 20 ms int16 frames at ``input_rate``, one per row."""
    resampled = soxr.resample(speech, rate, input_rate)
    size = frame_samples(input_rate)
    count = len(resampled) // size
    return (resampled[: count * size] * 32767).astype(np.int16).reshape(count, size)


def quality_scorer() -> Callable[[np.ndarray, np.ndarray], tuple[float, float]] | None:
    try:
        from pesq import pesq
        from pystoi import stoi
    except ImportError:
        return None

    def score(reference16: np.ndarray, decoded48: np.ndarray) -> tuple[float, float]:
        decoded16 = soxr.resample(decoded48, 48_000, 16_000)
        # Align the codec's delay (6.5 ms lookahead + the resampler's) by cross-correlation.
        span = len(reference16) - 800
        delay = max(
            range(400), key=lambda d: float(np.dot(reference16[:span], decoded16[d : d + span]))
        )
        out = decoded16[delay:]
        ref = reference16[: len(out)]
        return float(pesq(16_000, ref, out, "wb")), float(stoi(ref, out, 16_000))

    return score


def _name(setting: str, input_rate: int) -> str:
    return setting if input_rate == SAMPLE_RATE else f"{setting} @{input_rate // 1000}k"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--bitrate", type=int, default=32_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--wav", type=Path, default=SPEECH_WAV, help="mono 16-bit speech to encode")
    p.add_argument(
        "--input-rates",
        default=str(SAMPLE_RATE),
        help="comma-separated encoder input rates (Hz) to run every setting at",
    )
    args = p.parse_args()
    input_rates = [int(r) for r in args.input_rates.split(",")]
    if not set(input_rates) <= set(INPUT_RATES):
        p.error(f"--input-rates: each one of {INPUT_RATES}")
    speech, rate = read_wav(args.wav)
    speech16 = soxr.resample(speech, rate, 16_000)  # what PESQ-WB and STOI score against
    frames_at = {r: speech_frames(speech, rate, r) for r in input_rates}
    count = min(len(frames) for frames in frames_at.values())
    table = {(_name(name, r), r): apply for name, apply in settings().items() for r in input_rates}
    times: dict[tuple[str, int], list[float]] = {key: [] for key in table}
    for _ in range(args.rounds):
        for (name, r), apply in table.items():
            encoder = OpusEncoder(bitrate=args.bitrate, sample_rate=r)
            apply(encoder)
            started = time.process_time()
            for frame in frames_at[r][:count]:
                encoder.encode(frame)
            times[name, r].append((time.process_time() - started) / count)
            encoder.close()
    score = quality_scorer()
    print(f"# libopus encode, {args.bitrate} bit/s mono, {count} frames of speech x {args.rounds}")
    # The ratio: each setting's time against complexity 9 (the default) at the same input
    # rate, measured in the same rounds (this machine's speed cancels out).
    print(
        f"{'setting':31s} {'us/frame':>9s} {'x c9':>5s} {'kbit/s':>7s} {'PESQ-WB':>8s} {'STOI':>6s}"
    )
    for (name, r), apply in table.items():
        encoder, decoder = OpusEncoder(bitrate=args.bitrate, sample_rate=r), OpusDecoder()
        apply(encoder)
        packets = [encoder.encode(frame) for frame in frames_at[r][:count]]
        kbps = sum(map(len, packets)) * 8 / (count * 0.02) / 1000
        quality = "       -      -"
        if score is not None:
            decoded = np.concatenate([decoder.decode(pk) for pk in packets]) / 32768.0
            pesq_wb, stoi_ = score(speech16, decoded.astype(np.float32))
            quality = f"{pesq_wb:8.2f} {stoi_:6.3f}"
        median = float(np.median(times[name, r])) * 1e6
        baseline = float(np.median(times[_name("complexity 9", r), r])) * 1e6
        print(f"{name:31s} {median:9.0f} {median / baseline:5.2f} {kbps:7.1f} {quality}")
    if score is None:
        print("(quality columns: pip install pesq pystoi)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
