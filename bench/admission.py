"""Admission under load: offers past --max-sessions, all at once, timed.

A server process (the product's CLI with the test tone engine, ``tests.serve_tone``) with
``--max-sessions M`` gets N offers at the same instant (N > M), several rounds. Printed per
round: how long the refused offers took to get their 503 ``server_full`` and the admitted
ones their answer (POST to response; p50 / max, and the ratio refused/admitted), and the
admitted sessions' audio over a few seconds of speech: packets per second and the largest
inter-arrival gap at the client, and how often the server's audio clock had to move
forward because its event loop was late by more than 60 ms (cumulative; 0 = the server kept
time, so gaps seen at the client come from the client process, which decodes every
admitted stream).

    .venv/bin/python bench/admission.py                   # M=10, N=30, 3 rounds
    .venv/bin/python bench/admission.py --max-sessions 20 --offers 60 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.server_process import ServerProcess  # noqa: E402
from tests.storm import offer_storm  # noqa: E402


async def main(opts: argparse.Namespace) -> int:
    # Clients leave without DELETE: no resume grace, so the next round finds the room empty.
    flags = [
        *("--max-sessions", str(opts.max_sessions), "--offer-burst", str(10 * opts.offers)),
        *("--resume-grace", "0"),
    ]
    server = ServerProcess(["tests.serve_tone"], flags)
    ok = True
    try:
        await server.ready()
        print(
            f"{opts.offers} offers at once, --max-sessions {opts.max_sessions}; times in ms\n"
            f"{'round':>5} {'admitted':>8} {'refused':>7} {'503 p50':>8} {'503 max':>8} "
            f"{'200 p50':>8} {'200 max':>8} {'503/200':>8} {'pkt/s min':>9} {'gap max':>8} "
            f"{'srv late':>8}"
        )
        for n in range(1, opts.rounds + 1):
            r = await offer_storm(server.url, opts.offers, opts.listen)
            refused = statistics.median(r.refused_s) if r.refused_s else float("nan")
            answered = statistics.median(r.answered_s) if r.answered_s else float("nan")
            print(
                f"{n:>5} {len(r.answered_s):>8} {len(r.refused_s):>7} {refused * 1e3:>8.0f} "
                f"{max(r.refused_s, default=0) * 1e3:>8.0f} {answered * 1e3:>8.0f} "
                f"{max(r.answered_s, default=0) * 1e3:>8.0f} {refused / answered:>8.2f} "
                f"{min(r.rates, default=0):>9.1f} {max(r.largest_gaps, default=0) * 1e3:>8.0f} "
                f"{r.server_late:>8.0f}"
            )
            ok = ok and len(r.answered_s) == opts.max_sessions
            await asyncio.sleep(2)  # the closed sessions leave
    finally:
        status = server.stop()
    return 0 if ok and status == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-sessions", type=int, default=10)
    parser.add_argument("--offers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--listen", type=float, default=3.0, help="seconds of audio measured")
    sys.exit(asyncio.run(main(parser.parse_args())))
