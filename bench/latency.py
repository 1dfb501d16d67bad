"""Speech-onset latency: a PCM chunk leaving the engine -> the RTP packet carrying its first sample.

Every session speaks ``--utterances`` short utterances (0.6-1.2 s of tone), each after
silence (a random ``--gap-min``..``--gap-max`` s pause after the previous one finished
playing). Four server variants, each its own process, at each N:

  ``ours``       the product's ``OpusPacketTrack`` (re-phases its clock on speech onset)
                 on its lean send path (agent/direct.py),
  ``ours-aiortc`` the same track through aiortc's RTP sender task,
  ``norephase``  ``ours`` with ``rephase_on_onset=False``,
  ``default``    aiortc's default path (AudioFrames paced like ``AudioStreamTrack``,
                 encoded by aiortc in its executor).

Timestamps (``time.monotonic()``, one clock for all processes on this machine):
  engine  the bench engine (a ``ToneEngine`` subclass) just before it yields the first chunk
          of the utterance (its text starts with a unique token);
  sent    in the server, when ``RTCRtpSender`` holds the encoded payload of the utterance's
          first frame (RTP header + SRTP + sendto follow synchronously, tens of microseconds);
          on the lean send path, right after that frame's packet was handed to ``sendto``;
  client  arrival at the aiortc client on loopback of the first non-silent packet after the
          silence (payloads decoded after the run): an upper bound of "leaving the server"
          (on the lean send path it can read below ``sent``, stamped once sendto returned).

    .venv/bin/python bench/latency.py --quick
    .venv/bin/python bench/latency.py                 # N = 1,50, 20 utterances per session
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
from _common import Client, Server, complexity_cell, pct, system_busy, system_steal, table

VARIANTS = ("ours", "ours-aiortc", "norephase", "default")
TARGET_P50_MS = 5.0
TARGET_P99_MS = 20.0
# Fewer onsets than this give no p99 (20 samples' "p99" is about their maximum, below the
# true p99 four times in five: an N=1 run said "yes" on it; found by review).
MIN_P99_SAMPLES = 100


def run_one(n: int, variant: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    server_args = [
        "--variant",
        variant,
        "--mode",
        "latency",
        "--complexity",
        str(args.complexity),
        *_common.governor_args(args),
        "--encode-threads",
        str(args.encode_threads),
        "--input-rate",
        args.input_rate,
        "--utterances",
        str(args.utterances),
        "--gap-min",
        str(args.gap_min),
        "--gap-max",
        str(args.gap_max),
        "--chunk-delay",
        str(args.chunk_delay),
        "--seed",
        str(args.seed),
        "--workers",
        str(args.workers),
    ]
    tag = f"{variant}-{n}-w{args.workers}"
    server = Server(server_args, workdir / f"server-{tag}.log", [0] if args.pin else None)
    client = None
    steal0 = system_steal()
    busy0, wall0, cpu0, wait0 = (
        system_busy(),
        time.monotonic(),
        server.cpu(),
        server.runqueue_wait(),
    )
    try:
        client = Client(
            server.url,
            n,
            workdir / f"client-{tag}.log",
            [1] if args.pin else None,
            receive=args.client_receive,
        )
        deadline = time.monotonic() + 30 + args.utterances * (args.gap_max + 2.0)
        while True:
            time.sleep(1.0)
            stats = server.stats()
            done = sum(s["done"] for s in stats["sessions"].values())
            if done >= n or time.monotonic() > deadline:
                break
        time.sleep(0.3)  # the last onsets' packets are in flight
        others = system_busy() - busy0 - (server.cpu() - cpu0) - (client.cpu() - client.cpu0)
        others_pct = max(0.0, others) / (time.monotonic() - wall0) * 100
        steal_pct = (system_steal() - steal0) / (time.monotonic() - wall0) * 100
        wait_pct = (server.runqueue_wait() - wait0) / (time.monotonic() - wall0) * 100
        out = client.finish(0.0, float("inf"), workdir / f"client-{tag}.json")
    finally:
        server.stop()
        if client is not None:
            client.stop()
    engine_at = stats["first_chunk_at"]
    onsets = {s["session_id"]: sorted(s["onsets"]) for s in out["streams"]}
    sent: list[float] = []  # per utterance with a sent stamp
    arrived: list[float] = []  # ... of those, the ones a client heard
    buffered: list[float] = []  # the first frame lands in the playout buffer
    marked: list[float] = []  # the track's recv fires the frame's speech.started mark
    for sid, s in stats["sessions"].items():
        client_onsets = onsets.get(sid, [])
        for token, t_engine in sorted(
            ((k, v) for k, v in engine_at.items() if k in s["started_at"]), key=lambda kv: kv[1]
        ):
            t_sent = s["sent_at"].get(token)
            if t_sent is None:
                continue  # missing (counted below)
            sent.append((t_sent - t_engine) * 1000)
            buffered.append((s["buffered_at"][token] - t_engine) * 1000)
            marked.append((s["started_at"][token] - t_engine) * 1000)
            later = [t for t in client_onsets if t >= t_engine]
            if later:
                arrived.append((later[0] - t_engine) * 1000)
    return {
        "n": n,
        "variant": variant,
        "sessions_done": done,
        "utterances": len(sent),
        # Every utterance asked for: those never stamped as sent (a session that died or
        # ran past the deadline, speech that never started) are missing as well as those
        # no client heard; percentiles over the rest alone looked like a clean run.
        "expected": n * args.utterances,
        "missing": n * args.utterances - len(arrived),
        "others_cpu_pct": others_pct,
        "steal_pct": steal_pct,
        "server_wait_pct": wait_pct,
        "sent_ms": sent,
        "client_ms": arrived,
        "buffered_ms": buffered,
        "marked_ms": marked,
        **_common.governor_figures(stats),
    }


def summarize(results: list[dict[str, Any]]) -> str:
    out = []
    for n in sorted({r["n"] for r in results}):
        by = {r["variant"]: r for r in results if r["n"] == n}
        rows = []
        base = by.get("default")
        norep = by.get("norephase")
        for variant in VARIANTS:
            r = by.get(variant)
            if r is None:
                continue
            s50, s99 = pct(r["sent_ms"], 50), pct(r["sent_ms"], 99)
            c50, c99 = pct(r["client_ms"], 50), pct(r["client_ms"], 99)
            rel_default = (
                s50 / pct(base["sent_ms"], 50) if base and variant != "default" else float("nan")
            )
            rel_norep = (
                s50 / pct(norep["sent_ms"], 50) if norep and variant == "ours" else float("nan")
            )
            # A run that lost utterances or sessions failed, whatever its percentiles.
            complete = not r["missing"] and r["sessions_done"] >= r["n"]
            enough = len(r["sent_ms"]) >= MIN_P99_SAMPLES
            ok = complete and s50 <= TARGET_P50_MS and (s99 <= TARGET_P99_MS or not enough)
            verdict = ("yes" if enough else "p50 only") if ok else "NO"
            rows.append(
                [
                    variant,
                    f"{len(r['client_ms'])}/{r.get('expected', r['utterances'])}",
                    f"{r['sessions_done']}/{r['n']}",
                    s50,
                    pct(r["sent_ms"], 90),
                    s99,
                    max(r["sent_ms"], default=float("nan")),
                    c50,
                    c99,
                    rel_norep,
                    rel_default,
                    r["others_cpu_pct"],
                    r["server_wait_pct"],
                    complexity_cell(r),
                    verdict,
                ]
            )
        out.append(f"\n## N={n}  (ms from the engine's first chunk)")
        out.append(
            table(
                [
                    "track",
                    "heard/asked",
                    "sessions done",
                    "sent p50",
                    "sent p90",
                    "sent p99",
                    "sent max",
                    "client p50",
                    "client p99",
                    "p50/norephase",
                    "p50/default",
                    "others CPU%",
                    "loop wait%",
                    "cplx",
                    f"p50<={TARGET_P50_MS:g} & p99<={TARGET_P99_MS:g}",
                ],
                rows,
            )
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", default="1,50", help="comma-separated peer counts")
    p.add_argument("--utterances", type=int, default=20, help="per session")
    p.add_argument("--gap-min", type=float, default=0.3)
    p.add_argument("--gap-max", type=float, default=0.7)
    p.add_argument("--complexity", type=int, default=9)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--workers", type=int, default=1, help="media processes (serve --workers) per server"
    )
    _common.add_run_arguments(
        p, max_wait=2.0, retries=1, quick_help="N=1,10 with 6 utterances each"
    )
    args = p.parse_args()
    if args.quick:
        args.n = "1,10"
        args.utterances = 6
        args.retries = 0
    ns = [int(x) for x in args.n.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        p.error(f"unknown variants: {', '.join(sorted(unknown))}")
    print(
        f"# bench/latency.py  N={ns}  utterances/session={args.utterances}  gaps "
        f"{args.gap_min}-{args.gap_max}s  complexity={args.complexity}  pin={args.pin}  "
        f"workers={args.workers}  "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    started = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-latency-") as tmp:
        workdir = Path(tmp)
        for n in ns:
            for variant in variants:
                best = None
                for attempt in range(1 + args.retries):
                    print(f"  running N={n} {variant} (try {attempt + 1}) ...", flush=True)
                    try:
                        r = run_one(n, variant, args, workdir)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"  FAILED N={n} {variant}: {exc}", flush=True)
                        for log in sorted(workdir.glob(f"*-{variant}-{n}-w*.log")):
                            print(f"  --- {log.name}\n" + log.read_text()[-2000:], flush=True)
                        continue
                    if best is None or r["server_wait_pct"] < best["server_wait_pct"]:
                        best = r
                    if not _common.disturbed(r, args.max_wait, retry_left=attempt < args.retries):
                        break
                if best is not None:
                    results.append(best)
    print(summarize(results))
    print(
        "\n'loop wait%': share of the run the server's event-loop thread was runnable but had no "
        "CPU (/proc schedstat); 'others CPU%': other processes on the machine (of 200%)."
    )
    print(
        "'sent': server-side, RTCRtpSender has the payload (sendto follows synchronously); "
        "'client': arrival on loopback (upper bound)."
    )
    print(
        f"targets: p50 <= {TARGET_P50_MS:g} ms, p99 <= {TARGET_P99_MS:g} ms "
        f"(a p99 from {MIN_P99_SAMPLES} onsets or more: 'p50 only' below that, e.g. "
        f"--utterances {MIN_P99_SAMPLES} at N=1); total {time.time() - started:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
