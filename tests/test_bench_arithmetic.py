"""The benches' arithmetic (bench/streams.py, bench/latency.py): each test drives the bench's
own code with a known input and checks the verdict it prints. Each failed on the code as a
review found it (each says which figure was wrong and in which direction); the smoke tests
of tests/test_bench_*.py ran the harness but checked none of its arithmetic.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import _common  # noqa: E402
import latency  # noqa: E402
import streams  # noqa: E402

from agent.opus import OpusEncoder  # noqa: E402
from tests.test_bench_harness import _latency_result  # noqa: E402

# ------------------------------------------------------------------------------------------
# streams.py: gaps over 40 ms pooled over all streams
# ------------------------------------------------------------------------------------------


def _payload() -> bytes:
    enc = OpusEncoder()
    try:
        return enc.encode(np.zeros(enc.frame_samples, dtype=np.int16))
    finally:
        enc.close()


def _recording(arrivals: list[float], payload: bytes) -> _common.Recording:
    rec = _common.Recording(session_id=f"s{len(arrivals)}-{arrivals[0]:.3f}")
    rec.arrivals = list(arrivals)
    rec.seqs = list(range(len(arrivals)))
    rec.payloads = [payload] * len(arrivals)
    return rec


class _FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += max(0.0, s)


class _FakeServer:
    url = "http://fake"

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def rss(self) -> int:
        return 100 << 20

    def cpu(self) -> float:
        return 0.0

    def runqueue_wait(self) -> float:
        return 0.0

    def threads(self) -> int:
        return 1

    def stats(self) -> dict[str, Any]:
        return {"sessions": {}}

    def stop(self) -> None:
        pass


def _fake_client(payload: bytes, n: int, bursty: int) -> type:
    class Client:
        flowing = n
        connect_s = 1.0

        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def cpu(self) -> float:
            return 0.0

        def finish(self, t0: float, t1: float, out: Path) -> dict[str, Any]:
            recs = []
            for i in range(n):
                if i < bursty:
                    # 50 packets/s, but in bursts of 3 every 60 ms: a third of this stream's
                    # gaps are ~58 ms (what a listener hears as a stutter every 60 ms).
                    arr = [t0 + 0.06 * (k // 3) + 0.001 * (k % 3) for k in range(500)]
                else:
                    arr = [t0 + 0.02 * k + 0.0005 for k in range(500)]
                recs.append(_common.analyse_recording(_recording(arr, payload), t0, t1))
            return {"streams": recs}

        def stop(self) -> None:
            pass

    return Client


def _streams_args() -> argparse.Namespace:
    return argparse.Namespace(
        complexity=9,
        complexity_floor=None,
        full_band_under_load=False,
        encode_threads=0,
        input_rate="auto",
        bitrate=32_000,
        signal="tone",
        chunk_delay=0.05,
        seed=1,
        no_listen=True,
        pin=False,
        client_receive="fast",
        warmup=1.0,
        seconds=10.0,
        talk=2.0,
        silence=2.0,
    )


def test_one_stuttering_stream_among_100_fails_the_real_time_verdict(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue: "at N=100 ... every stream at 50 packets/s with at most 0.5% of gaps over
    40 ms". Bug: the gaps were pooled over all streams, so one stream with 33% of its gaps
    over 40 ms (a stutter every 60 ms at a full 50 packets/s) read 0.33% among 100 and the
    run printed real time. The worst stream is judged now."""
    payload = _payload()
    monkeypatch.setattr(streams, "time", _FakeClock())
    monkeypatch.setattr(streams, "Server", _FakeServer)
    monkeypatch.setattr(streams, "Client", _fake_client(payload, n=100, bursty=1))
    r = streams.run_one(100, "ours", "continuous", _streams_args(), tmp_path)
    assert r["pps_min"] >= 49.5  # every stream at 50 packets/s: that part holds
    assert not streams.holds_real_time(r), (
        f"pooled gap share {r['gap_share'] * 100:.2f}% hides a stream with 33% gaps > 40 ms"
    )


# ------------------------------------------------------------------------------------------
# streams.py: the ratio verdict against a governed (lower-quality) run
# ------------------------------------------------------------------------------------------


def _streams_result(variant: str, cpu: float, pps: float, **kw: Any) -> dict[str, Any]:
    n = 50
    base = {
        "n": n,
        "variant": variant,
        "pattern": "continuous",
        "connected": n,
        "cpu_per_stream_pct": cpu / n,
        "server_cpu_pct": cpu,
        "pps_total": pps * n,
        "pps_min": pps,
        "pps_median": pps,
        "streams_below_49_5pps": 0 if pps >= 49.5 else n,
        "gap_share": 0.0 if pps >= 49.5 else 0.5,
        "max_gap_ms": 30.0,
        "rss_per_peer_mib": 0.5,
        "speech_share": 1.0,
        "underruns_per_stream_s": 0.0,
        "client_cpu_pct": 10.0,
        "others_cpu_pct": 0.0,
        "server_wait_pct": 0.0,
        "steal_pct": 0.0,
        "complexity": None,
        "rung": None,
        "complexity_steps_down": 0,
        "complexity_steps_up": 0,
    }
    base.update(kw)
    return base


def test_the_ratio_verdict_is_not_met_by_a_governed_run_against_an_overloaded_baseline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bug: "ratio X (meets 0.35)" was printed for any N. At N=50 ours runs at the governor's
    medium-band complexity 0 (cplx mb0, 5 steps down) and the default path is overloaded
    (20 packets/s): the ratio (~0.2) compared a degraded encode with a saturated baseline and
    said "meets", where at the configured complexity 9 it is ~0.45. Now n/a, with why."""
    ours = _streams_result(
        "ours", cpu=60.0, pps=50.0, complexity=0, rung="mb0", complexity_steps_down=5
    )
    default = _streams_result("default", cpu=120.0, pps=20.0)

    def fake_run_one(n: int, variant: str, *a: Any, **k: Any) -> dict[str, Any]:
        return dict(ours if variant == "ours" else default)

    monkeypatch.setattr(streams, "run_one", fake_run_one)
    monkeypatch.setattr(
        sys,
        "argv",
        ["streams.py", "--n", "50", "--patterns", "continuous", "--retries", "0"],
    )
    streams.main()
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "continuous: ratio" in x)
    assert "meets" not in line, line


# ------------------------------------------------------------------------------------------
# latency.py: p99 of a handful of samples
# ------------------------------------------------------------------------------------------


def _latency_run(sent: list[float]) -> dict[str, Any]:
    """One session's latency result whose onsets were ``sent`` (ms), all heard."""
    return {
        **_latency_result(len(sent), 1, n=1, asked=len(sent)),
        "sent_ms": sent,
        "client_ms": sent,
    }


def _verdict(out: str) -> str:
    row = next(x for x in out.splitlines() if x.startswith("ours"))
    return row.split()[-1]


def test_p99_of_20_onsets_does_not_pass_a_server_whose_p99_is_25_ms() -> None:
    """Bug: N=1 runs 20 utterances (6 with --quick), and np.percentile(..., 99) of 20 samples
    is about their maximum. A server with 1 ms onsets except 2% at 25 ms has a true p99 of
    25 ms (target 20 ms); 20 samples hold none of the slow ones 0.98**20 = 67% of the time,
    and the run printed p99 ~1 ms and "yes". Under 100 onsets it says "p50 only" now."""
    rng = random.Random(0)
    passes = 0
    trials = 300
    for _ in range(trials):
        sent = [25.0 if rng.random() < 0.02 else 1.0 + rng.random() * 0.5 for _ in range(20)]
        if _verdict(latency.summarize([_latency_run(sent)])) == "yes":
            passes += 1
    assert passes / trials < 0.05, (
        f"a p99=25 ms server passed the 20 ms p99 target in {passes}/{trials} runs"
    )
