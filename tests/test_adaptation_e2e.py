"""Network adaptation end to end: real packet loss (tests/netem.py's UDP relay) between the
real server and an aiortc client; the server's controller reacts to the client's receiver
reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import pytest

from agent.config import AdaptationSettings, Config
from agent.session import AgentSession
from signaling.keys import SESSIONS
from tests.conftest import LiveServer
from tests.netem import LossyRelay
from tests.rtc_client import RtcClient, opus_fmtp_rewriter
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.timeout(90)

CEILING = 32_000


@pytest.fixture
def server_config() -> Config:
    # FEC hold-off shortened so that "FEC goes off after the loss" fits in a test.
    return Config(host="127.0.0.1", port=0, adaptation=AdaptationSettings(fec_off_after_s=4.0))


async def _connect(
    live_server: LiveServer, http: aiohttp.ClientSession, relay: LossyRelay
) -> tuple[RtcClient, AgentSession]:
    client = RtcClient(live_server.url, http)
    with_fec = opus_fmtp_rewriter("minptime=10;useinbandfec=1")
    await client.connect(
        rewrite_offer=lambda sdp: relay.rewrite_offer(with_fec(sdp)),
        rewrite_answer=relay.rewrite_answer,
    )
    assert client.session_id is not None
    return client, live_server.app[SESSIONS].get(client.session_id).session


async def _wait_for(
    session: AgentSession, predicate: Callable[[AgentSession], bool], timeout: float
) -> float:
    """Seconds until ``predicate(session)`` held (polled every 20 ms); fails on timeout."""
    start = time.monotonic()
    while not predicate(session):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out; network stats: {session.network.stats()}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def _reports(session: AgentSession) -> int:
    tap = session.network.tap
    assert tap is not None
    return tap.receiver_reports


async def test_ten_percent_loss_lowers_bitrate_and_turns_on_fec_then_recovers(
    live_server: LiveServer,
) -> None:
    async with aiohttp.ClientSession() as http, LossyRelay(seed=11) as relay:
        client, session = await _connect(live_server, http, relay)
        try:
            encoder = session.track.encoder
            # Clean path: several receiver reports, bitrate stays at the top, no FEC.
            await _wait_for(session, lambda s: _reports(s) >= 3, timeout=10)
            assert encoder.bitrate == CEILING and not encoder.fec
            assert session.network.controller.loss == 0.0

            relay.set_loss(downstream=0.10)
            reports_at_loss = _reports(session)
            await _wait_for(session, lambda s: s.track.encoder.fec, timeout=10)
            await _wait_for(session, lambda s: s.track.encoder.bitrate < CEILING, timeout=10)
            # Within three report intervals: the second or third report after the loss began
            # did it (two reports of 10% loss sampled over 50 packets each can read 6-8%,
            # which the controller does not tell from noise on a 4% path: agent/bitrate.py).
            assert _reports(session) - reports_at_loss <= 3, session.network.stats()
            assert encoder.expected_loss_pct >= 6
            await asyncio.sleep(4)
            lowest = encoder.bitrate
            assert lowest < CEILING and encoder.fec
            assert relay.downstream.rtp_dropped > 0
            # /metrics shows it too: loss, FEC's expected loss and the lowered bitrate.
            metrics = await scrape(http, live_server.url)
            stat = "voice_agent_session_stat"
            assert value(metrics, stat, stat="loss", agg="max") > 0.03
            assert value(metrics, stat, stat="expected_loss_pct", agg="max") >= 6
            assert value(metrics, stat, stat="bitrate", agg="max") < CEILING

            relay.set_loss(downstream=0.0)
            await _wait_for(session, lambda s: s.track.encoder.bitrate == CEILING, timeout=20)
            await _wait_for(session, lambda s: not s.track.encoder.fec, timeout=15)
            assert encoder.expected_loss_pct == 0
            assert session.network.applier.changes >= 3
        finally:
            await client.close()


async def test_clean_path_stays_at_the_top(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http, LossyRelay(seed=3) as relay:
        client, session = await _connect(live_server, http, relay)
        try:
            client.send({"type": "say", "text": "clean path " * 20, "id": "c"})
            await _wait_for(session, lambda s: _reports(s) >= 5, timeout=15)
            assert session.track.encoder.bitrate == CEILING
            assert not session.track.encoder.fec
            assert session.network.applier.changes == 0
            assert relay.downstream.rtp_dropped == 0
            # The RTT, from our SRs' recorded send times (not their NTP stamps), is loopback's.
            # (Waited for: on a loaded machine the first reports may all predate our first
            # sender report, and name none.)
            await _wait_for(session, lambda s: s.network.controller.rtt_s is not None, 15)
            rtt = session.network.controller.rtt_s
            assert rtt is not None and rtt < 0.1, session.network.stats()
        finally:
            await client.close()


async def test_loss_without_receiver_fec_support_changes_bitrate_only(
    live_server: LiveServer,
) -> None:
    """aiortc's own offer has no useinbandfec: no FEC however lossy the path is."""
    async with aiohttp.ClientSession() as http, LossyRelay(seed=5, downstream_loss=0.2) as relay:
        client = RtcClient(live_server.url, http)
        await client.connect(rewrite_offer=relay.rewrite_offer, rewrite_answer=relay.rewrite_answer)
        try:
            assert client.session_id is not None
            session = live_server.app[SESSIONS].get(client.session_id).session
            await _wait_for(session, lambda s: s.track.encoder.bitrate < CEILING, timeout=10)
            assert not session.track.encoder.fec
        finally:
            await client.close()
