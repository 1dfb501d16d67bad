"""Soak: many cycles of connect, speak, disconnect against a server process; then a leak check.

The server is the product's CLI and shutdown path with the test tone engine
(``python -m tests.serve_tone``) in its own process, lifecycle timers shortened so abrupt
disconnects are cleaned up in seconds (--rtcp-timeout 3, --resume-grace 1). Cycles run a few
at a time; each connects a Python WebRTC client, has the agent say two words, waits for
``speech.ended``, and leaves in one of three ways, in turn:

- ``goodbye``: DELETE /sessions/{id}, then close;
- ``hang-up``: close the peer connection without DELETE (DTLS close reaches the server:
  the session is detached, then closed after the grace);
- ``blackout``: the client sits behind tests/netem.py's relay, which drops everything from
  then on (the server notices by the missing RTCP, then the grace runs out).

Measured in the server process (psutil) and from its /metrics (asyncio tasks, sessions):
RSS, open file descriptors, threads, asyncio tasks at the start, after the warm-up cycles
(sessions all closed) and at the end (sessions all closed). Targets: RSS growth after
warm-up under 10%; descriptors, threads and tasks back to their post-warm-up baseline.

    .venv/bin/python bench/soak.py                       # 500 cycles, 50 of them warm-up
    .venv/bin/python bench/soak.py --cycles 100 --warmup 20 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import psutil  # noqa: E402

from tests.netem import LossyRelay  # noqa: E402
from tests.rtc_client import RtcClient  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

MODES = ("goodbye", "hang-up", "blackout")
SERVER_FLAGS = [
    *("--offer-rate", "1000000", "--offer-burst", "1000000"),
    *("--speech-rate", "1000000", "--speech-burst", "1000000", "--max-sessions", "200"),
    *("--rtcp-timeout", "3", "--resume-grace", "1", "--connect-timeout", "5"),
    *("--idle-timeout", "0", "--seconds-per-word", "0.1"),
]


async def figures(proc: psutil.Process, http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    metrics: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("voice_agent_asyncio_tasks "):
            metrics["tasks"] = float(line.split()[1])
        elif line.startswith("voice_agent_sessions_active{"):
            metrics["sessions"] = metrics.get("sessions", 0.0) + float(line.split()[1])
    return {
        "rss_mib": proc.memory_info().rss / 2**20,
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
        **metrics,
    }


async def settled(proc: psutil.Process, http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Figures once every session is closed (abrupt ones take the RTCP timeout + grace)."""
    deadline = time.monotonic() + 30
    while True:
        now = await figures(proc, http, url)
        if now.get("sessions", 0) == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(2.0)  # closing tasks finish, the watchdog ticks
    now = await figures(proc, http, url)
    proc.send_signal(signal.SIGUSR1)  # tests/serve_tone.py: glibc malloc_trim(0)
    await asyncio.sleep(0.5)
    now["rss_trimmed_mib"] = proc.memory_info().rss / 2**20
    return now


async def cycle(
    index: int, modes: tuple[str, ...], url: str, http: aiohttp.ClientSession, errors: Counter[str]
) -> str:
    mode = modes[index % len(modes)]
    try:
        if mode == "blackout":
            async with LossyRelay() as relay:
                client = RtcClient(url, http)
                await client.connect(
                    rewrite_offer=relay.rewrite_offer, rewrite_answer=relay.rewrite_answer
                )
                await speak(client, index)
                relay.blackout = True
                await client.close()
            return mode
        client = RtcClient(url, http)
        await client.connect()
        await speak(client, index)
        if mode == "goodbye":
            async with http.delete(f"{url}/sessions/{client.session_id}") as resp:
                if resp.status != 204:
                    errors[f"delete {resp.status}"] += 1
        await client.close()
    except Exception as exc:  # noqa: BLE001 - counted and printed: a soak reports, not stops
        errors[type(exc).__name__] += 1
    return mode


async def speak(client: RtcClient, index: int) -> None:
    client.send({"type": "say", "text": "hello there", "id": f"s{index}"})
    await client.wait_event(lambda e: e["type"] == "speech.ended", 10)


async def run_cycles(
    start: int,
    count: int,
    opts: argparse.Namespace,
    url: str,
    http: aiohttp.ClientSession,
) -> tuple[Counter[str], Counter[str]]:
    errors: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    queue = iter(range(start, start + count))

    async def worker() -> None:
        for index in queue:
            modes[await cycle(index, opts.modes, url, http, errors)] += 1

    await asyncio.gather(*(worker() for _ in range(opts.concurrency)))
    return modes, errors


async def main(opts: argparse.Namespace) -> int:
    log_path = Path(tempfile.gettempdir()) / f"soak-server-{time.time():.0f}.log"
    with log_path.open("wb") as log:
        return await soak(opts, log_path, log)


async def soak(opts: argparse.Namespace, log_path: Path, log: Any) -> int:
    server = ServerProcess(["tests.serve_tone"], SERVER_FLAGS, log)
    try:
        await server.ready()
        proc = psutil.Process(server.proc.pid)
        async with aiohttp.ClientSession() as http:
            start = await figures(proc, http, server.url)
            t0 = time.monotonic()
            warm_modes, warm_errors = await run_cycles(0, opts.warmup, opts, server.url, http)
            t_warm = time.monotonic()  # the settle wait below is not the warm-up's cycling
            baseline = await settled(proc, http, server.url)
            t1 = time.monotonic()
            modes, errors = await run_cycles(
                opts.warmup, opts.cycles - opts.warmup, opts, server.url, http
            )
            t2 = time.monotonic()
            end = await settled(proc, http, server.url)
    finally:
        status = server.stop()
    modes += warm_modes
    errors += warm_errors
    growth = (end["rss_mib"] - baseline["rss_mib"]) / baseline["rss_mib"]
    print(
        f"{opts.cycles} cycles ({', '.join(f'{n} {m}' for m, n in sorted(modes.items()))}), "
        f"{opts.concurrency} at a time: warm-up {opts.warmup} in {t_warm - t0:.0f} s "
        f"({opts.warmup / max(t_warm - t0, 1e-9):.1f} cycles/s), "
        f"the rest in {t2 - t1:.0f} s ({(opts.cycles - opts.warmup) / (t2 - t1):.1f} cycles/s)"
    )
    print(f"client-side errors: {dict(errors) or 'none'}; server exit status {status}")
    print(f"{'':14}{'start':>10}{'warm-up':>10}{'end':>10}{'end/warm-up':>13}")
    for key, label in [
        ("rss_mib", "RSS MiB"),
        ("rss_trimmed_mib", "RSS trimmed"),
        ("fds", "open fds"),
        ("threads", "threads"),
        ("tasks", "asyncio tasks"),
        ("sessions", "sessions"),
    ]:
        ratio = end[key] / baseline[key] if baseline.get(key) else float("nan")
        print(
            f"{label:14}{start.get(key, 0):10.1f}{baseline.get(key, 0):10.1f}"
            f"{end.get(key, 0):10.1f}{ratio:13.3f}"
        )
    trimmed = (end["rss_trimmed_mib"] - baseline["rss_trimmed_mib"]) / baseline["rss_trimmed_mib"]
    print(
        f"RSS growth after warm-up: {growth * 100:+.1f}% (target < 10%); "
        f"after malloc_trim (heap free space returned to the OS): {trimmed * 100:+.1f}%"
    )
    ok = (
        growth < 0.10
        and end["fds"] <= baseline["fds"]
        and end["threads"] <= baseline["threads"]
        and end["tasks"] <= baseline["tasks"]
        and end["sessions"] == 0
        and not errors
        and status == 0
    )
    print("PASS" if ok else "FAIL", f"(server log: {log_path})")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=5)
    parser.add_argument(
        "--modes",
        type=lambda text: tuple(text.split(",")),
        default=MODES,
        help=f"ways to leave, in turn (default {','.join(MODES)})",
    )
    sys.exit(asyncio.run(main(parser.parse_args())))
