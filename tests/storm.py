"""Offers past the admission limit, all at once: who got in, how fast the rest were told no,
and whether the admitted sessions' audio stayed on time. Used by tests/test_admission_load.py
(correctness) and bench/admission.py (figures)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from dataclasses import dataclass, field

import aiohttp

from tests.rtc_client import RtcClient


@dataclass
class StormResult:
    answered_s: list[float] = field(default_factory=list)  # POST -> 200, admitted ones
    refused_s: list[float] = field(default_factory=list)  # POST -> 503, refused ones
    refusals: list[tuple[int, str, str | None]] = field(
        default_factory=list
    )  # status, code, Retry-After
    rates: list[float] = field(default_factory=list)  # packets/s per admitted session
    largest_gaps: list[float] = field(default_factory=list)  # seconds, per admitted session
    gap_times: list[float] = field(
        default_factory=list
    )  # when each largest gap ended (s into window)
    server_late: float = 0.0  # times the server's audio clock had to move forward


async def offer_storm(url: str, offers: int, listen_s: float = 3.0) -> StormResult:
    """``offers`` clients post at once; the admitted ones listen to speech for ``listen_s``."""
    result = StormResult()
    async with aiohttp.ClientSession() as http:
        clients = [RtcClient(url, http) for _ in range(offers)]
        arrivals: list[list[float]] = [[] for _ in clients]
        for client, times in zip(clients, arrivals, strict=True):
            client.rtp_tap = lambda _s, _p, times=times: times.append(time.monotonic())

        async def one(client: RtcClient) -> None:
            await client.connect(allow_refusal=True)
            took = client.offer_seconds or 0.0  # the HTTP exchange, not the client's ICE
            if client.refusal is None:
                result.answered_s.append(took)
            else:
                status, body, headers = client.refusal
                result.refused_s.append(took)
                result.refusals.append((status, body["error"]["code"], headers.get("Retry-After")))

        try:
            await asyncio.gather(*(one(c) for c in clients))
            admitted = [(c, t) for c, t in zip(clients, arrivals, strict=True) if c.refusal is None]
            for client, _ in admitted:
                client.send({"type": "say", "text": " ".join(["talk"] * 40)})
            await asyncio.sleep(0.5)  # settle: every admitted session is sending
            # The 30 clients' objects make a full collection in *this* process a pause of
            # ~0.1 s, which would show up as a gap in every stream at once: collect now and
            # not during the window (the server is what is measured, not the test client).
            collecting = time.monotonic()
            gc.collect()
            collected_s = time.monotonic() - collecting
            gc.disable()
            try:
                # The packets that queued while the collection ran (long in a test process
                # that ran other tests first) are read, and stamped, before the window opens:
                # stamped inside it, they read as 57-76 packets/s (CI, 2026-12-01).
                await asyncio.sleep(0.25 + 2 * collected_s)
                window_start = time.monotonic()
                await asyncio.sleep(listen_s)
                window_end = time.monotonic()
            finally:
                gc.enable()
            for _, times in admitted:
                window = [t for t in times if window_start <= t <= window_end]
                if len(window) < 2:
                    result.rates.append(0.0)
                    result.largest_gaps.append(listen_s)
                    continue
                result.rates.append((len(window) - 1) / (window[-1] - window[0]))
                gap, end = max((b - a, b) for a, b in itertools.pairwise(window))
                result.largest_gaps.append(gap)
                result.gap_times.append(end - window_start)
            async with http.get(url + "/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("voice_agent_late_packets_total "):
                        result.server_late = float(line.split()[1])
        finally:
            await asyncio.gather(*(c.close() for c in clients))
    return result
