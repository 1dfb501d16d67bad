"""Admission under load: 30 offers at once against --max-sessions 10 (server in its own
process). The admitted sessions' audio stays on time; the rest get 503 server_full quickly."""

from __future__ import annotations

import pytest

from tests.server_process import ServerProcess
from tests.storm import offer_storm

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.serial]


async def test_offers_past_the_limit_are_refused_quickly_and_admitted_audio_stays_on_time() -> None:
    server = ServerProcess(["tests.serve_tone"], ["--max-sessions", "10", "--offer-burst", "100"])
    try:
        await server.ready()
        result = await offer_storm(server.url, 30)
    finally:
        assert server.stop() == 0
    assert len(result.answered_s) == 10
    assert len(result.refused_s) == 20
    assert {(status, code) for status, code, _ in result.refusals} == {(503, "server_full")}
    assert all(retry is not None and int(retry) >= 1 for _, _, retry in result.refusals)
    # Refused before any media is set up: quicker than the slowest admitted offer.
    assert max(result.refused_s) < 2.0, result.refused_s
    assert all(45 <= rate <= 55 for rate in result.rates), result.rates
    assert max(result.largest_gaps) <= 0.1, result.largest_gaps
