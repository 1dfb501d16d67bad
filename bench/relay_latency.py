"""A room speaker's voice to a listener: time from the speaker's microphone to the listener.

One room, two aiortc clients on the real server (tone engine): a speaker whose microphone
(tests/mic.py's ClipMic) plays a 0.2 s 1 kHz burst every 0.6 s, and a listener subscribed to
the speaker's slot. Measured per burst: the frame holding the burst's first sample leaving
the speaker's microphone track -> the first loud frame of the slot's track at the listener
(after the client's own receive path, aiortc's jitter buffer included, which both variants
share). Two variants, alternated:

  prompt   the product: the speaker's receiver releases each packet as it arrives
           (agent/receive_buffer.py); the listener's browser does the jitter buffering
  aiortc   aiortc's own jitter buffer on the speaker's receiver (4 frames held: 80 ms)

Prints each variant's median and the ratio prompt/aiortc. Server and clients share one
process and event loop (loopback: the network adds nothing).

    .venv/bin/python bench/relay_latency.py              # 3 rounds x 8 bursts per variant
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from unittest import mock

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config import Config, RoomSettings
from tests.conftest import serve
from tests.doubles import ToneEngine
from tests.mic import ClipMic
from tests.rtc_client import RtcClient

RATE = 48_000
BURST_S = 0.2
PERIOD_S = 0.6
LOUD_RMS = 0.05  # the burst is 0.5 peak (0.35 rms); silence decodes to ~0


async def one_round(bursts: int) -> list[float]:
    """Milliseconds from each burst leaving the speaker's microphone to the listener."""
    config = Config(host="127.0.0.1", port=0, rooms=RoomSettings())
    mic = ClipMic()
    delays: list[float] = []
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        speaker = RtcClient(server.url, http)
        listener = RtcClient(server.url, http)
        try:
            await speaker.connect(room="relay", mic=mic, slots=1)
            await listener.connect(room="relay", slots=1)
            await asyncio.sleep(1.5)  # both connections up, the slot's track flowing
            slot = listener.slot_audio[0]
            t = np.arange(int(BURST_S * RATE)) / RATE
            burst = 0.5 * np.sin(2 * np.pi * 1000 * t)
            for _ in range(bursts):
                first = len(slot.frames)
                mic.play(burst, RATE)
                await asyncio.sleep(PERIOD_S)
                sent = mic.sent_at(0)
                for frame, arrived in zip(slot.frames[first:], slot.arrivals[first:], strict=False):
                    if float(np.sqrt(np.mean(frame**2))) > LOUD_RMS:
                        delays.append((arrived - sent) * 1000)
                        break
        finally:
            await listener.close()
            await speaker.close()
    return delays


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=8)
    args = parser.parse_args()
    found: dict[str, list[float]] = {"prompt": [], "aiortc": []}
    for _ in range(args.rounds):
        found["prompt"] += await one_round(args.bursts)
        # install_receive_buffer "succeeds" without touching the receiver: aiortc's stays.
        with mock.patch("agent.room.install_receive_buffer", return_value=True):
            found["aiortc"] += await one_round(args.bursts)
    medians = {name: statistics.median(values) for name, values in found.items()}
    for name, values in found.items():
        print(
            f"{name:7s} bursts {len(values):3d}  median {medians[name]:6.1f} ms"
            f"  max {max(values):6.1f} ms"
        )
    print(f"ratio prompt/aiortc (median): {medians['prompt'] / medians['aiortc']:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
