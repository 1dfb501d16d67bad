"""One room with N listeners vs N separate 1:1 sessions: what an added listener costs.

For each N, two runs back to back, each with its own server process (the real app, a
``ToneEngine`` paced at 2x real time, the agent always speaking: every frame is encoded):
- ``room``: N receive-only peers join one room; the room's agent speaks continuously. Its
  speech is encoded once per 20 ms and fanned out to the N subscriber tracks.
- ``solo``: N ordinary 1:1 sessions, each agent speaking continuously (one encode per
  session per 20 ms), the product's normal path.
The N peers are aiortc clients in one separate process that only record packet arrivals
(bench/_common.py's recorder). Server CPU is the server process's CPU time (psutil) over the
window. Printed per N: encoder calls per second (room: must not grow with N), server CPU, CPU
per listener, the cost of an added listener in the room (the slope from the smallest N), and
its ratio to a 1:1 session's cost (solo CPU / N at the same N). Target: <= 0.3.

    .venv/bin/python bench/room.py --quick           # N = 1, 10, 6 s windows
    .venv/bin/python bench/room.py                   # N = 1, 10, 50, 100, 10 s windows
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROOM = "bench"
# room: fan-out with the lean send path (agent/direct.py, the default); room-aiortc: fan-out
# through each listener's aiortc RTP sender; solo: N separate 1:1 sessions.
MODES = ("room", "room-aiortc", "solo")
TARGET_RATIO = 0.3
REALTIME_PPS = 48.0  # packets/s per listener a run must deliver to count as real time
TEXT = " ".join(["word"] * 120)  # 30 s of tone per utterance


# --- server role ---------------------------------------------------------------------------
def serve(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="room.py server")
    p.add_argument("--mode", choices=MODES, required=True)
    opts = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    import _common
    from aiohttp import web

    from agent.config import Config, LimitSettings, RoomSettings
    from signaling.app import build_app
    from signaling.keys import SESSIONS
    from tests.doubles import ToneEngine

    engine = ToneEngine(chunk_delay_s=0.05)
    config = Config(
        host="127.0.0.1",
        port=0,
        log_level="WARNING",
        limits=LimitSettings(offer_rate=1000, offer_burst=1000, max_sessions=1000),
        rooms=RoomSettings(max_participants=1000, direct_send=opts.mode == "room"),
    )
    app = build_app(config, engine)
    registry = app[SESSIONS]

    def pipelines() -> list[Any]:
        if opts.mode != "solo":
            return [room.pipeline for room in registry.rooms.rooms()]
        return [peer.session.pipeline for peer in registry.peers()]

    async def driver(app: web.Application) -> Any:
        async def loop() -> None:
            while True:  # keep one utterance queued behind the one speaking, everywhere
                for pipeline in pipelines():
                    if pipeline.queued < 1:
                        pipeline.say(TEXT)
                await asyncio.sleep(0.2)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    async def stats(request: web.Request) -> web.Response:
        if opts.mode != "solo":
            encodes = sum(r.agent_track.stats.encode_calls for r in registry.rooms.rooms())
        else:
            encodes = sum(p.session.track.stats.encode_calls for p in registry.peers())
        sent = sum(p.session.track.stats.packets for p in registry.peers())
        return web.json_response({"encode_calls": encodes, "packets_sent": sent})

    app.cleanup_ctx.append(driver)
    app.router.add_get("/bench/stats", stats)

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await _common.app_ready(app)()
        print(f"READY {port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_reader(sys.stdin.fileno(), stop.set)  # the orchestrator closed our stdin
        await stop.wait()
        os._exit(0)

    asyncio.run(main())


# --- client role ---------------------------------------------------------------------------
def client(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="room.py client")
    p.add_argument("--url", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--room", default=None)
    opts = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)
    asyncio.run(_client_main(opts))


async def _client_main(opts: argparse.Namespace) -> None:
    import _common
    import aiohttp
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    _common._install_client_patches()
    pcs: list[Any] = []
    recs: list[Any] = []

    async def connect(http: aiohttp.ClientSession) -> None:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        transceiver = pc.addTransceiver("audio", direction="recvonly")
        rec = _common.Recording()
        transceiver.receiver.bench_recording = rec
        await pc.setLocalDescription(await pc.createOffer())
        body = {"sdp": pc.localDescription.sdp, "type": "offer"}
        if opts.room:
            body["room"] = opts.room
        async with http.post(opts.url + "/offer", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"offer failed: {resp.status} {await resp.text()}")
            data = await resp.json()
        await pc.setRemoteDescription(RTCSessionDescription(sdp=data["sdp"], type="answer"))
        pcs.append(pc)
        recs.append(rec)

    async with aiohttp.ClientSession() as http:
        for i in range(0, opts.n, 10):
            await asyncio.gather(*(connect(http) for _ in range(min(10, opts.n - i))))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(len(r.arrivals) < 5 for r in recs):
        await asyncio.sleep(0.05)
    print(f"CONNECTED {sum(len(r.arrivals) >= 5 for r in recs)}", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0, t1 = (float(x) for x in line.split()[1:3])
    _common._RECORDING[0] = False
    counts = []
    for rec in recs:
        counts.append(sum(1 for t in rec.arrivals if t0 <= t < t1))
    print("DONE " + json.dumps(counts), flush=True)
    os._exit(0)


# --- orchestrator --------------------------------------------------------------------------
def _spawn(args: list[str], log: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__)), *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )


def run_one(mode: str, n: int, seconds: float, workdir: Path) -> dict[str, Any]:
    import urllib.request

    import psutil

    log = (workdir / f"{mode}-{n}.log").open("w")
    server = _spawn(["server", "--mode", mode], log)
    clients: subprocess.Popen[str] | None = None
    try:
        assert server.stdout and server.stdin
        ready = server.stdout.readline()
        if not ready.startswith("READY"):
            raise RuntimeError(f"server failed: {ready!r}, see {log.name}")
        url = f"http://127.0.0.1:{ready.split()[1]}"
        args = ["client", "--url", url, "--n", str(n)]
        clients = _spawn([*args, "--room", ROOM] if mode != "solo" else args, log)
        assert clients.stdout and clients.stdin
        connected = clients.stdout.readline()
        if not connected.startswith("CONNECTED"):
            raise RuntimeError(f"clients failed: {connected!r}, see {log.name}")
        time.sleep(2.0)  # settle: connections done, speech flowing everywhere

        def bench_stats() -> dict[str, Any]:
            with urllib.request.urlopen(url + "/bench/stats", timeout=30) as resp:
                stats: dict[str, Any] = json.loads(resp.read())
                return stats

        ps = psutil.Process(server.pid)
        s0, c0, t0 = bench_stats(), sum(ps.cpu_times()[:2]), time.monotonic()
        time.sleep(seconds)
        s1, c1, t1 = bench_stats(), sum(ps.cpu_times()[:2]), time.monotonic()
        clients.stdin.write(f"STOP {t0!r} {t1!r}\n")
        clients.stdin.flush()
        done = clients.stdout.readline()
        counts = json.loads(done.split(" ", 1)[1])
        window = t1 - t0
        return {
            "mode": mode,
            "n": n,
            "flowing": int(connected.split()[1]),
            "cpu_pct": 100 * (c1 - c0) / window,
            "encodes_per_s": (s1["encode_calls"] - s0["encode_calls"]) / window,
            "packets_per_s_per_listener": sum(counts) / len(counts) / window if counts else 0,
        }
    finally:
        for proc in (clients, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", default="1,10,50,100", help="listener counts, comma-separated")
    p.add_argument("--seconds", type=float, default=10.0, help="measurement window per run")
    p.add_argument("--quick", action="store_true", help="N = 1,10 and 6 s windows")
    p.add_argument("--json", type=Path, default=None, help="write the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="re-print saved results")
    args = p.parse_args()
    if args.from_json:
        print(report(json.loads(args.from_json.read_text())))
        return
    counts = [1, 10] if args.quick else [int(x) for x in args.n.split(",")]
    seconds = 6.0 if args.quick else args.seconds
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-room-") as tmp:
        for n in counts:
            for mode in MODES:
                result = run_one(mode, n, seconds, Path(tmp))
                results.append(result)
                print(
                    f"  {mode:11} N={n:3}: server CPU {result['cpu_pct']:6.1f}%  "
                    f"encodes/s {result['encodes_per_s']:7.1f}  "
                    f"packets/s per listener {result['packets_per_s_per_listener']:5.1f}",
                    flush=True,
                )
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def report(results: list[dict[str, Any]]) -> str:
    by = {(r["mode"], r["n"]): r for r in results}
    ns = sorted({r["n"] for r in results})
    rooms = [m for m in MODES if m != "solo" and (m, ns[0]) in by]
    # A 1:1 session's cost from a run that kept real time: a run that fell behind did less
    # work per session than real time needs.
    realtime = [n for n in ns if by[("solo", n)]["packets_per_s_per_listener"] >= REALTIME_PPS]
    all_modes, room_modes = ", ".join([*rooms, "solo"]), ", ".join(rooms)
    lines = [
        "",
        f"| N | encodes/s ({all_modes}) | server CPU % ({all_modes}) "
        f"| added listener, % of a core ({room_modes}) | 1:1 session "
        f"| ratio ({room_modes}) | packets/s per listener ({all_modes}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in ns:
        kept_up = n in realtime
        ref = n if kept_up else max((m for m in realtime if m <= n), default=None)
        per_session = by[("solo", ref)]["cpu_pct"] / ref if ref is not None else None
        added: list[float | None] = []
        for mode in rooms:
            base = by[(mode, ns[0])]
            added.append(
                (by[(mode, n)]["cpu_pct"] - base["cpu_pct"]) / (n - ns[0]) if n > ns[0] else None
            )
        ratios = [a / per_session if a is not None and per_session else None for a in added]
        # A room run that fell behind did less than real-time work: its figures flatter it.
        behind = [by[(m, n)]["packets_per_s_per_listener"] < REALTIME_PPS for m in rooms]
        mark = "" if kept_up else f" (N={ref})" if ref is not None else ""
        modes = [*rooms, "solo"]
        encodes = ", ".join(f"{by[(m, n)]['encodes_per_s']:.0f}" for m in modes)
        cpu = ", ".join(f"{by[(m, n)]['cpu_pct']:.1f}" for m in modes)
        pps = ", ".join(f"{by[(m, n)]['packets_per_s_per_listener']:.1f}" for m in modes)
        lines.append(
            f"| {n} | {encodes} | {cpu} | {_starred(added, behind)} "
            f"| {_f(per_session)}{mark} | {_starred(ratios, behind)} | {pps} |"
        )
    lines.append(
        f"\nCPU in % of one core. added listener: (room CPU at N - room CPU at N={ns[0]}) / "
        f"(N - {ns[0]}); 1:1 session: solo CPU / N, taken from the largest N whose solo run "
        f"kept real time (>= {REALTIME_PPS} packets/s per listener) when the run at N fell "
        f"behind; ratio = added listener / 1:1 session (target <= {TARGET_RATIO}). room: the "
        "lean send path (agent/direct.py); room-aiortc: each listener through its aiortc sender."
        " *: that room run fell behind real time (its figure is not a cost; rerun on a quieter "
        "machine)."
    )
    return "\n".join(lines)


def _starred(values: list[float | None], behind: list[bool]) -> str:
    return ", ".join(_f(v) + ("*" if b else "") for v, b in zip(values, behind, strict=True))


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("server", "client"):
        (serve if sys.argv[1] == "server" else client)(sys.argv[2:])
    else:
        main()
