"""Concealed audio under real packet loss: the bitrate controller on vs fixed 32 kbps, no FEC.

For each loss rate, two sessions run one after the other in this process, each through its
own ``tests.netem.LossyRelay`` with the same seed (the Nth RTP packet meets the same draw in
both runs): the real server (``build_app``) speaks the same ~20 s of speech (espeak-ng, or a
tone where espeak-ng is missing) to an aiortc client whose offer says ``useinbandfec=1``:

- ``on``: the product's default, network adaptation (agent/bitrate.py) driven by the client's
  RTCP receiver reports;
- ``off``: adaptation disabled, Opus fixed at 32 kbps without FEC (what a fixed encoder does).

The client records every RTP packet that crosses the relay (sequence number, payload). After
the run a receiver like a browser's is replayed with libopus: a received packet is decoded; a
lost one is recovered from the next packet's in-band FEC when that packet arrived and carries
it, and concealed (PLC) otherwise. Printed per rate: lost and concealed fractions of the
speech, the ratio on/off, the highest encoder target and the highest 1 s payload bitrate.

    .venv/bin/python bench/loss.py                  # 5%, 10%, 20% loss, ~20 s of speech each
    .venv/bin/python bench/loss.py --quick          # 10% only, ~10 s of speech
    .venv/bin/python bench/loss.py --rates 0.1 --seeds 1,2,3

Target (issue 4): at 10% loss at least 40% less concealed audio with the controller
(ratio <= 0.60), and the bitrate never above the configured ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
import soxr  # noqa: E402
from aiohttp import web  # noqa: E402

from agent.config import AdaptationSettings, Config, OpusSettings  # noqa: E402
from agent.opus import OpusDecoder, packet_has_fec  # noqa: E402
from signaling.app import build_app  # noqa: E402
from signaling.keys import SESSIONS  # noqa: E402
from tests.doubles import ClipEngine  # noqa: E402
from tests.netem import LossyRelay  # noqa: E402
from tests.rtc_client import RtcClient, opus_fmtp_rewriter  # noqa: E402

SPEECH = (
    "Streaming speech for a live voice agent should start quickly and sound smooth. "
    "When packets go missing on the way to the listener, the receiver has to fill the gaps, "
    "and every gap it invents is audio the listener never heard. Forward error correction "
    "sends a coarse copy of each frame inside the next one, so a single lost packet can be "
    "rebuilt instead of guessed."
)
CEILING = 32_000
WARMUP_PACKETS = 150  # 3 s of packets through the lossy relay before speech starts


@dataclass
class Recording:
    packets: dict[int, bytes] = field(default_factory=dict)  # unwrapped seq -> payload
    last_raw: int | None = None
    unwrapped: int = 0

    def add(self, seq: int, payload: bytes) -> int:
        if self.last_raw is None:
            self.unwrapped = seq
        else:
            delta = (seq - self.last_raw + 0x8000) % 0x10000 - 0x8000
            self.unwrapped += delta
        self.last_raw = seq
        self.packets[self.unwrapped] = payload
        return self.unwrapped


@dataclass
class RunResult:
    mode: str
    rate: float
    seed: int
    frames: int
    lost: int
    recovered: int
    concealed: int
    max_target: int
    max_payload_kbps: float
    fec_seen: bool

    @property
    def concealed_fraction(self) -> float:
        return self.concealed / self.frames if self.frames else 0.0


def speech_clip() -> tuple[np.ndarray, int, str]:
    """~20 s of espeak-ng speech at 48 kHz, or a tone when espeak-ng is not installed."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        t = np.arange(48_000) / 48_000
        return (0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 48_000, "tone"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([espeak, "-w", str(path), SPEECH], check=True)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    audio = soxr.resample(pcm.astype(np.float32) / 32768, rate, 48_000)
    peak = float(np.max(np.abs(audio))) or 1.0
    return (0.7 * audio / peak).astype(np.float32), 48_000, "espeak-ng speech"


def replay_receiver(recording: Recording, first: int, last: int) -> tuple[int, int, int]:
    """(lost, recovered by FEC, concealed) over packets first..last, like a browser's NetEq."""
    decoder = OpusDecoder()
    lost = recovered = concealed = 0
    packets = recording.packets
    for seq in range(first, last + 1):
        payload = packets.get(seq)
        if payload is not None:
            decoder.decode(payload)
            continue
        lost += 1
        following = packets.get(seq + 1)
        if following is not None and packet_has_fec(following):
            decoder.recover(following)
            recovered += 1
        else:
            decoder.conceal()
            concealed += 1
    decoder.close()
    return lost, recovered, concealed


async def one_run(
    mode: str, rate: float, seed: int, clip: np.ndarray, clip_rate: int, seconds: float
) -> RunResult:
    adaptation = AdaptationSettings(enabled=mode == "on")
    config = Config(
        host="127.0.0.1",
        port=0,
        opus=OpusSettings(bitrate=CEILING, fec=False),
        adaptation=adaptation,
    )
    words = max(1, round(seconds / 0.25))
    engine = ClipEngine(clip, clip_rate, seconds_per_word=0.25)
    app = build_app(config, engine)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    recording = Recording()
    marks: dict[str, int] = {}
    try:
        async with (
            aiohttp.ClientSession() as http,
            LossyRelay(seed=seed, downstream_loss=rate) as relay,
        ):
            client = RtcClient(url, http)
            with_fec = opus_fmtp_rewriter("minptime=10;useinbandfec=1")
            client.rtp_tap = recording.add
            await client.connect(
                rewrite_offer=lambda sdp: relay.rewrite_offer(with_fec(sdp)),
                rewrite_answer=relay.rewrite_answer,
            )
            assert client.session_id is not None
            session = app[SESSIONS].get(client.session_id).session
            while relay.downstream.rtp_seen < WARMUP_PACKETS:
                await asyncio.sleep(0.005)
            client.send({"type": "say", "text": "word " * words, "id": "speech"})
            await client.wait_event(lambda e: e.get("type") == "speech.started", timeout=10)
            marks["first"] = recording.unwrapped + 1
            targets: list[int] = []
            payload_kbps: list[float] = []
            last_bytes, last_time = session.track.stats.bytes, time.monotonic()
            ended = False
            while not ended:
                await asyncio.sleep(0.1)
                targets.append(session.track.encoder.bitrate)
                now = time.monotonic()
                if now - last_time >= 1.0:
                    sent = session.track.stats.bytes
                    payload_kbps.append((sent - last_bytes) * 8 / (now - last_time) / 1000)
                    last_bytes, last_time = sent, now
                ended = any(e.get("type") == "speech.ended" for e in client.events)
            marks["last"] = recording.unwrapped - 10  # the tail is silence after speech
            fec_seen = any(packet_has_fec(p) for p in recording.packets.values())
            await client.close()
    finally:
        await runner.cleanup()
    lost, recovered, concealed = replay_receiver(recording, marks["first"], marks["last"])
    return RunResult(
        mode=mode,
        rate=rate,
        seed=seed,
        frames=marks["last"] - marks["first"] + 1,
        lost=lost,
        recovered=recovered,
        concealed=concealed,
        max_target=max(targets),
        max_payload_kbps=max(payload_kbps) if payload_kbps else 0.0,
        fec_seen=fec_seen,
    )


def concealed_fraction(runs: list[RunResult]) -> float:
    return sum(r.concealed for r in runs) / max(1, sum(r.frames for r in runs))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", default="0.05,0.10,0.20", help="downstream RTP loss rates")
    ap.add_argument("--seeds", default="1", help="relay seeds; results are summed over them")
    ap.add_argument("--seconds", type=float, default=20.0, help="speech per run")
    ap.add_argument("--quick", action="store_true", help="10%% loss, 10 s of speech")
    args = ap.parse_args()
    rates = [0.10] if args.quick else [float(r) for r in args.rates.split(",")]
    seconds = 10.0 if args.quick else args.seconds
    seeds = [int(s) for s in args.seeds.split(",")]
    clip, clip_rate, source = speech_clip()
    print(
        f"speech: {source}, {seconds:.0f} s per run; ceiling {CEILING // 1000} kbps; "
        f"receiver replayed with libopus (FEC from the next packet, else PLC)\n"
    )
    header = (
        f"{'loss':>5} {'mode':>4} {'frames':>7} {'lost':>6} {'FEC-rec':>8} {'concealed':>10} "
        f"{'conc %':>7} {'max target':>11} {'max 1s kbps':>12}"
    )
    print(header)
    ratios: dict[float, float] = {}
    for rate in rates:
        by_mode: dict[str, list[RunResult]] = {"off": [], "on": []}
        for seed in seeds:
            for mode in ("off", "on"):
                by_mode[mode].append(await one_run(mode, rate, seed, clip, clip_rate, seconds))
        for mode in ("off", "on"):
            runs = by_mode[mode]
            frames = sum(r.frames for r in runs)
            concealed = sum(r.concealed for r in runs)
            print(
                f"{rate:>5.0%} {mode:>4} {frames:>7} {sum(r.lost for r in runs):>6} "
                f"{sum(r.recovered for r in runs):>8} {concealed:>10} "
                f"{100 * concealed / max(1, frames):>6.2f}% {max(r.max_target for r in runs):>11} "
                f"{max(r.max_payload_kbps for r in runs):>12.1f}"
            )
        off = sum(r.concealed for r in by_mode["off"]) / max(
            1, sum(r.frames for r in by_mode["off"])
        )
        on = sum(r.concealed for r in by_mode["on"]) / max(1, sum(r.frames for r in by_mode["on"]))
        ratios[rate] = on / off if off else float("nan")
        over = [r for r in by_mode["on"] if r.max_target > CEILING]
        print(
            f"      concealed on/off = {ratios[rate]:.2f}"
            f"{'  (target <= 0.60)' if abs(rate - 0.10) < 1e-9 else ''}"
            f"{'  CEILING EXCEEDED' if over else ''}\n"
        )
    if 0.10 in ratios:
        verdict = "met" if ratios[0.10] <= 0.60 else "MISSED"
        print(
            f"10% loss: {1 - ratios[0.10]:.0%} less concealed audio with the controller ({verdict})"
        )
    print("median ratio over rates:", round(statistics.median(ratios.values()), 2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
