"""N concurrent peers receiving agent speech: our pre-encoded Opus track vs aiortc's default path.

For each N and each speech pattern, two runs back to back, each with its own server process:
``ours`` (the product's ``OpusPacketTrack``: 20 ms Opus packets encoded by libopus via
ctypes, cached silence packets) and ``default`` (the same pipeline and playout buffer feeding
a track that returns s16 48 kHz ``AudioFrame`` s paced like aiortc's ``AudioStreamTrack``, so
aiortc encodes them with its own Opus encoder in its executor). The N peers are aiortc
clients in one separate process that only record packet arrivals (no jitter buffer, no live
decoding; payloads are decoded after the window). Server CPU comes from the server process's
CPU time over the window (psutil), RSS per peer from the server's RSS growth over its idle
baseline divided by N.

Speech patterns: ``continuous`` (every session always has an utterance queued: it never
stops talking, so every frame is encoded) and ``intermittent`` (talk ~``--talk`` s, silence
~``--silence`` s, random phase per session: about 50% talk time by default).

    .venv/bin/python bench/streams.py --quick
    .venv/bin/python bench/streams.py                      # N = 10,50,100, 20 s windows
    .venv/bin/python bench/streams.py --n 10,50 --seconds 30 --complexity 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from _common import (
    Client,
    Server,
    complexity_cell,
    parallel_speedup,
    pct,
    system_busy,
    system_steal,
    table,
)

MIB = 1024 * 1024
TARGET_RATIO = 0.35
TARGET_GAP_SHARE = 0.005
TARGET_RSS_MIB = 1.0
VARIANTS = ("ours", "ours-aiortc", "default")


def run_one(
    n: int, variant: str, pattern: str, args: argparse.Namespace, workdir: Path, workers: int = 1
) -> dict[str, Any]:
    server_args = [
        "--workers",
        str(workers),
        "--variant",
        variant,
        "--mode",
        pattern,
        "--complexity",
        str(args.complexity),
        *_common.governor_args(args),
        "--encode-threads",
        str(args.encode_threads),
        "--input-rate",
        args.input_rate,
        "--bitrate",
        str(args.bitrate),
        "--signal",
        args.signal,
        "--chunk-delay",
        str(args.chunk_delay),
        "--seed",
        str(args.seed),
    ]
    if args.no_listen:
        server_args.append("--no-listen")
    if pattern == "continuous":
        server_args += ["--talk-s", "60"]
    else:
        server_args += ["--talk-s", str(args.talk), "--silence-s", str(args.silence)]
    tag = f"{pattern}-{variant}-{n}-w{workers}"
    server = Server(server_args, workdir / f"server-{tag}.log", [0] if args.pin else None)
    client = None
    try:
        time.sleep(1.0)
        rss0 = server.rss()
        client = Client(
            server.url,
            n,
            workdir / f"client-{tag}.log",
            [1] if args.pin else None,
            receive=args.client_receive,
        )
        warmup = (
            args.warmup if pattern == "continuous" else max(args.warmup, args.talk + args.silence)
        )
        time.sleep(warmup)
        s0 = server.stats()
        t0, cpu0, ccpu0, busy0 = time.monotonic(), server.cpu(), client.cpu(), system_busy()
        steal0 = system_steal()
        wait0 = server.runqueue_wait()
        rss_peak = server.rss()
        end = t0 + args.seconds
        while (now := time.monotonic()) < end:
            time.sleep(min(1.0, end - now))
            rss_peak = max(rss_peak, server.rss())
        t1, cpu1, ccpu1, busy1 = time.monotonic(), server.cpu(), client.cpu(), system_busy()
        steal1 = system_steal()
        wait1 = server.runqueue_wait()
        threads = server.threads()
        s1 = server.stats()
        out = client.finish(t0, t1, workdir / f"client-{tag}.json")
    finally:
        server.stop()
        if client is not None:
            client.stop()
    wall = t1 - t0
    streams = out["streams"]
    pps = [s["packets"] / wall for s in streams]
    gaps_total = sum(s["gaps_total"] for s in streams)
    gaps_over = sum(s["gaps_over_40ms"] for s in streams)

    def delta(key: str) -> int:
        return sum(
            v[key] - s0["sessions"].get(sid, {}).get(key, 0) for sid, v in s1["sessions"].items()
        )

    return {
        "n": n,
        "workers": workers,
        "variant": variant,
        "pattern": pattern,
        "signal": args.signal,
        "input_rate": args.input_rate,
        "window_s": wall,
        "connected": client.flowing,
        "connect_s": client.connect_s,
        "cpu_per_stream_pct": (cpu1 - cpu0) / wall / n * 100,
        "server_cpu_pct": (cpu1 - cpu0) / wall * 100,
        "client_cpu_pct": (ccpu1 - ccpu0) / wall * 100,
        # Everything else on the machine (other people's jobs): contamination of the window.
        # Share of the window the server's event-loop thread was runnable but had no CPU.
        "server_wait_pct": (wait1 - wait0) / wall * 100,
        "others_cpu_pct": max(0.0, (busy1 - busy0) - (cpu1 - cpu0) - (ccpu1 - ccpu0)) / wall * 100,
        # CPU time the hypervisor gave other guests while ours were ready to run.
        "steal_pct": (steal1 - steal0) / wall * 100,
        "pps_total": sum(pps),
        "pps_min": min(pps) if pps else 0.0,
        "pps_median": pct(pps, 50),
        "streams_below_49_5pps": sum(p < 49.5 for p in pps),
        "gap_share": gaps_over / gaps_total if gaps_total else 1.0,
        # The "every stream ... at most 0.5% of gaps over 40 ms" is per stream: pooled,
        # one stuttering stream among 100 hid under the others (found by review).
        "worst_gap_share": max(
            (s["gaps_over_40ms"] / s["gaps_total"] if s["gaps_total"] else 1.0 for s in streams),
            default=1.0,
        ),
        "max_gap_ms": max((s["max_gap_ms"] for s in streams), default=0.0),
        "lost": sum(s["lost"] for s in streams),
        "speech_share": sum(s["speech_share"] for s in streams) / max(1, len(streams)),
        "kbps_per_stream": sum(s["bytes"] for s in streams)
        * 8
        / wall
        / max(1, len(streams))
        / 1000,
        "rss_per_peer_mib": (rss_peak - rss0) / n / MIB,
        "server_threads": threads,
        "underruns_per_stream_s": delta("underruns") / wall / n,
        "late_rephases": delta("late_rephases"),
        "encode_calls_per_stream_s": delta("encode_calls") / wall / n,
        "decode_errors": sum(s["decode_errors"] for s in streams),
        "undecryptable": sum(s.get("undecryptable", 0) for s in streams),
        "receiver_reports_per_stream_s": delta("receiver_reports") / wall / n,
        **_common.governor_figures(s1, s0),
    }


def _worst_gap_share(r: dict[str, Any]) -> float:
    """The worst stream's share of gaps over 40 ms (a run recorded before it: the pooled one)."""
    return float(r.get("worst_gap_share", r["gap_share"]))


def ratio_verdict(ours: dict[str, Any], default: dict[str, Any]) -> str:
    """The CPU ratio's verdict against the target: only where both paths held real time and
    ours kept its configured quality. A run whose governor stepped ours down (lower
    complexity, narrower band) against a baseline overloaded past real time gave a ratio
    of 0.2 that said "meets" (found by review): n/a, with the reason."""
    ratio = _per_rt_stream(ours) / _per_rt_stream(default)
    if not holds_real_time(default):
        return f"ratio {ratio:.2f} (n/a: the default path did not hold real time)"
    if not holds_real_time(ours):
        return f"ratio {ratio:.2f} (n/a: ours did not hold real time)"
    if ours.get("complexity_steps_down", 0) or ours.get("band_cap_hz"):
        return f"ratio {ratio:.2f} (n/a: the governor lowered ours' quality)"
    return f"ratio {ratio:.2f} ({'meets' if ratio <= TARGET_RATIO else 'misses'} {TARGET_RATIO})"


def _per_rt_stream(r: dict[str, Any]) -> float:
    """Server CPU per stream delivered at 50 packets/s (equals CPU%/stream in real time)."""
    total = r.get("pps_total", r["pps_median"] * r["n"])
    return r["server_cpu_pct"] / (total / 50) if total else float("nan")


def report(results: list[dict[str, Any]], pattern: str) -> str:
    rows = []
    by = {(r["n"], r["variant"]): r for r in results if r["pattern"] == pattern}
    for n in sorted({r["n"] for r in results if r["pattern"] == pattern}):
        for variant in VARIANTS:
            r = by.get((n, variant))
            if r is None:
                continue
            other = by.get((n, "default"))
            ratio = (
                _per_rt_stream(r) / _per_rt_stream(other)
                if variant != "default" and other
                else float("nan")
            )
            realtime = r["pps_min"] >= 49.5 and _worst_gap_share(r) <= TARGET_GAP_SHARE
            rows.append(
                [
                    n,
                    variant,
                    f"{r['connected']}/{n}",
                    r["cpu_per_stream_pct"],
                    _per_rt_stream(r),
                    ratio,
                    r["server_cpu_pct"],
                    r["pps_min"],
                    r["pps_median"],
                    r["gap_share"] * 100,
                    _worst_gap_share(r) * 100,
                    r["max_gap_ms"],
                    r["rss_per_peer_mib"],
                    r["speech_share"] * 100,
                    r["underruns_per_stream_s"],
                    r["client_cpu_pct"],
                    r["others_cpu_pct"],
                    r["server_wait_pct"],
                    complexity_cell(r),
                    "yes" if realtime else "NO",
                ]
            )
    headers = [
        "N",
        "track",
        "flowing",
        "CPU%/stream",
        "CPU%/50pps",
        "ours/dflt",
        "server CPU%",
        "pps min",
        "pps med",
        "gaps>40ms %",
        "worst stream %",
        "max gap ms",
        "RSS MiB/peer",
        "speech %",
        "underrun/s/str",
        "client CPU%",
        "others CPU%",
        "loop wait%",
        "cplx",
        "real time",
    ]
    return table(headers, rows)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", default="10,50,100", help="comma-separated peer counts")
    p.add_argument("--seconds", type=float, default=20.0, help="measurement window per run")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds after all peers flow")
    p.add_argument("--complexity", type=int, default=9, help="OpusSettings(complexity=...)")
    p.add_argument("--bitrate", type=int, default=32_000)
    p.add_argument(
        "--signal",
        choices=_common.SIGNALS,
        default="tone",
        help="what every session speaks: a tone (a few hundred Hz), or recorded speech "
        "(tests/data/speech.wav at 24 kHz, looped; its pauses lower 'speech %%')",
    )
    p.add_argument(
        "--patterns", default="continuous,intermittent", help="continuous and/or intermittent"
    )
    p.add_argument("--talk", type=float, default=2.0, help="intermittent: seconds of speech")
    p.add_argument("--silence", type=float, default=2.0, help="intermittent: seconds of silence")
    _common.add_run_arguments(
        p, max_wait=5.0, retries=2, quick_help="N=10, 6 s windows: a smoke run"
    )
    p.add_argument(
        "--variants",
        default="ours,default",
        help="server tracks to run at each N: ours (lean send path), ours-aiortc (the same "
        "track through aiortc's RTP sender), default (aiortc's default path; the ratio's base)",
    )
    p.add_argument("--from-json", type=Path, help="print the tables of a saved --json run")
    p.add_argument(
        "--no-listen",
        action="store_true",
        help="the server loads no voice activity model (faster start; for the harness tests)",
    )
    p.add_argument(
        "--workers",
        default="1",
        help="media processes (serve --workers); several, e.g. 1,2: capacity mode, the most "
        "continuously speaking streams each worker count holds in real time (over --n, "
        "ascending), and the ratio",
    )
    args = p.parse_args()
    worker_counts = [int(x) for x in args.workers.split(",") if x]
    if len(worker_counts) > 1 or worker_counts != [1]:
        return capacity(args, worker_counts)
    if args.quick:
        args.n = "10"
        args.seconds = 6.0
        args.warmup = 2.0
        args.retries = 0
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for pattern in dict.fromkeys(r["pattern"] for r in saved):
            print(f"\n## {pattern} speech")
            print(report(saved, pattern))
        return 0
    ns = [int(x) for x in args.n.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        p.error(f"unknown variants: {', '.join(sorted(unknown))}")
    patterns = [x for x in args.patterns.split(",") if x]
    results: list[dict[str, Any]] = []
    started = time.time()
    print(
        f"# bench/streams.py  N={ns}  window={args.seconds:g}s  complexity={args.complexity}  "
        f"bitrate={args.bitrate}  signal={args.signal}  "
        f"engine chunk_delay={args.chunk_delay}s/100ms  pin={args.pin}  "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        workdir = Path(tmp)
        for pattern in patterns:
            for n in ns:
                for variant in variants:
                    best = None
                    for attempt in range(1 + args.retries):
                        print(
                            f"  running {pattern} N={n} {variant} (try {attempt + 1}) ...",
                            flush=True,
                        )
                        try:
                            r = run_one(n, variant, pattern, args, workdir)
                        except Exception as exc:  # noqa: BLE001 - report and go on
                            print(f"  FAILED {pattern} N={n} {variant}: {exc}", flush=True)
                            for log in sorted(workdir.glob(f"*-{pattern}-{variant}-{n}-w*.log")):
                                print(f"  --- {log.name}\n" + log.read_text()[-2000:], flush=True)
                            continue
                        r["tries"] = attempt + 1
                        if best is None or r["server_wait_pct"] < best["server_wait_pct"]:
                            best = r
                        if not _common.disturbed(
                            r, args.max_wait, retry_left=attempt < args.retries
                        ):
                            break
                    if best is not None:
                        results.append(best)
    for pattern in patterns:
        talk = (
            ""
            if pattern == "continuous"
            else f" (~{args.talk:g} s talk / ~{args.silence:g} s silence)"
        )
        print(f"\n## {pattern} speech{talk}")
        print(report(results, pattern))
    print(
        f"\ntargets: CPU/stream ours <= {TARGET_RATIO}x default; N=100 every stream 50 pps with "
        f"<= {TARGET_GAP_SHARE * 100:g}% gaps > 40 ms; < {TARGET_RSS_MIB:g} MiB RSS per peer\n"
        "CPU% is % of one core; CPU%/50pps: server CPU per stream delivered at 50 packets/s "
        "(the ratio uses it; equal to CPU%/stream while real time holds); 'others CPU%': "
        "other processes on the machine during the window "
        "(of 200%); 'loop wait%': share of the window the server's event-loop thread was "
        "runnable but had no CPU (/proc schedstat): high values mean the run was disturbed."
    )
    for r in results:
        if r["variant"] == "ours" and r["pattern"] == "continuous":
            other = next(
                (
                    x
                    for x in results
                    if x["n"] == r["n"]
                    and x["variant"] == "default"
                    and x["pattern"] == r["pattern"]
                ),
                None,
            )
            if other:
                print(f"  N={r['n']} continuous: {ratio_verdict(r, other)}")
    print(f"total {time.time() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def holds_real_time(r: dict[str, Any]) -> bool:
    """Every stream got its 50 packets/s, and gaps over 40 ms stayed rare."""
    return (
        r["connected"] == r["n"]
        and r["streams_below_49_5pps"] == 0
        and _worst_gap_share(r) <= TARGET_GAP_SHARE
    )


def capacity(args: argparse.Namespace, worker_counts: list[int]) -> int:
    """Continuously speaking streams held in real time, per worker count, same run."""
    ns = sorted(int(x) for x in args.n.split(",") if x)
    print(
        f"# bench/streams.py capacity  workers={worker_counts}  N={ns}  window={args.seconds:g}s"
        f"  complexity={args.complexity}  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    # The machine's own ceiling: how much more work W CPU-bound processes do than one.
    ceilings = {w: parallel_speedup(w) for w in worker_counts if w > 1}
    for w, ceiling in ceilings.items():
        print(f"  machine: {w} CPU-bound processes do {ceiling:.2f}x the work of one", flush=True)
    held = dict.fromkeys(worker_counts, 0)
    rows: list[tuple[int, int, list[str]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
        # N ascending, every worker count still holding tried at each N in turn: the host's
        # load drifts over minutes (steal on a shared VM), and interleaving gives every
        # worker count the same conditions.
        climbing = list(worker_counts)
        for n in ns:
            for workers in list(climbing):
                best = None
                tries = passes = 0
                for attempt in range(1 + args.retries):
                    print(f"  workers={workers} N={n} (try {attempt + 1}) ...", flush=True)
                    r = run_one(n, "ours", "continuous", args, Path(tmp), workers)
                    tries += 1
                    passes += holds_real_time(r)
                    if best is None or holds_real_time(r):
                        best = r
                    # Any miss is tried again (not only a visibly disturbed one): steal
                    # comes and goes within seconds, and a capacity is what the server can
                    # hold, so each N gets the same chances whatever the worker count.
                    if holds_real_time(r):
                        break
                assert best is not None
                ok = holds_real_time(best)
                row = [
                    str(workers),
                    str(n),
                    f"{best['pps_min']:.1f}",
                    f"{best['pps_median']:.1f}",
                    f"{_worst_gap_share(best) * 100:.2f}",
                    f"{best['server_cpu_pct']:.0f}",
                    f"{best['client_cpu_pct']:.0f}",
                    f"{best['others_cpu_pct']:.0f}",
                    f"{best['steal_pct']:.0f}",
                    complexity_cell(best),
                    # held on the first try, or after misses (the best of several tries is
                    # no capacity on its own: found by review)
                    f"{'yes' if ok else 'no'} ({passes}/{tries} tries)",
                ]
                rows.append((workers, n, row))
                if ok:
                    held[workers] = n
                else:
                    climbing.remove(workers)
            if not climbing:
                break
    headers = [
        "workers",
        "N",
        "pps min",
        "pps med",
        "worst stream gaps>40ms %",
        "server CPU%",
        "client CPU%",
        "others CPU%",
        "steal %",
        "cplx",
        "real time",
    ]
    print(table(headers, [row for _, _, row in sorted(rows, key=lambda r: (r[0], r[1]))]))
    base = held.get(1) or held[worker_counts[0]]
    for workers in worker_counts:
        ratio = held[workers] / base if base else float("nan")
        line = f"  workers={workers}: {held[workers]} streams held in real time ({ratio:.2f}x)"
        if workers in ceilings:
            line += f"; the machine's {workers}-process ceiling is {ceilings[workers]:.2f}x"
        print(line)
    print("target (issue 8): workers=2 >= 1.8x workers=1 on a 2-core machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
