"""A well-formed session in a process of its own: keeps the agent talking and records when
each RTP packet arrives, so a test can check the audio stays on time while it hammers the
server from another process (its own work cannot then delay the measurement).

    python -m tests.monitor_client URL   # prints "ready"; on stdin EOF prints JSON arrivals
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

from tests.rtc_client import RtcClient

TEXT = " ".join(["speak"] * 40)  # 10 s of tone, said again whenever it ends


async def main(url: str) -> None:
    arrivals: list[float] = []
    async with aiohttp.ClientSession() as http:
        client = RtcClient(url, http)
        client.rtp_tap = lambda _seq, _payload: arrivals.append(time.monotonic())
        await client.connect()

        async def talk() -> None:
            n = 0
            while True:
                n += 1
                client.send({"type": "say", "text": TEXT, "id": f"m{n}"})
                await client.wait_event(
                    lambda e, i=n: e["type"] == "speech.ended" and e["id"] == f"m{i}", 60
                )

        talking = asyncio.ensure_future(talk())
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # until the test closes stdin
        talking.cancel()
        await client.close()
    print(json.dumps({"arrivals": arrivals, "session_id": client.session_id}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
