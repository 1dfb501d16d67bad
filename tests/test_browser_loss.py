"""Headless Chromium under 10% real packet loss (tests/netem.py relay): with the controller the
page sees the server's bitrate fall and Chromium conceals less than with the controller off.

Two runs in one test, same relay seed (the same RTP packets are dropped in both), same tone,
same server code; only ``AdaptationSettings.enabled`` differs. Chromium offers
``useinbandfec=1`` and transport-cc, so the controller hears about loss within a fraction of
a second (transport-cc feedback) and its in-band FEC lets NetEq rebuild lost frames.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from agent.config import AdaptationSettings, Config
from signaling.app import build_app
from signaling.keys import SESSIONS
from tests.doubles import ToneEngine
from tests.netem import LossyRelay, playwright_offer_route
from tests.test_browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    HAVE_CHROMIUM,
    INBOUND_JS,
    REQUIRE_BROWSER,
    AgentPage,
    connect,
    say_in_ui,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(150), pytest.mark.serial]

try:
    from playwright.async_api import async_playwright
except ImportError:  # pragma: no cover - test_browser already fails/skips the same way
    if REQUIRE_BROWSER:
        raise
    pytest.skip("playwright is not installed", allow_module_level=True)

SEED = 21
LOSS = 0.10
WORDS = 40  # 10 s of tone
CEILING = 32_000


@asynccontextmanager
async def serving(adaptive: bool) -> AsyncIterator[tuple[str, web.Application]]:
    config = Config(host="127.0.0.1", port=0, adaptation=AdaptationSettings(enabled=adaptive))
    app = build_app(config, ToneEngine())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


async def one_call(browser: Any, adaptive: bool) -> dict[str, Any]:
    """A call through a 10%-loss relay; concealment over one utterance and the page's stats."""
    async with (
        serving(adaptive) as (url, app),
        LossyRelay(seed=SEED, downstream_loss=LOSS) as relay,
    ):
        context = await browser.new_context()
        page = await context.new_page()
        page.set_default_timeout(20_000)
        ap = AgentPage(page)
        page.on("console", lambda m: ap.log.append(f"console.{m.type}: {m.text}"))
        await page.route("**/offer", playwright_offer_route(relay))
        await page.goto(url + "/")
        await page.wait_for_function("() => window.voiceAgent !== undefined")
        await connect(ap)
        # Let the controller hear about the loss before the utterance starts.
        await page.wait_for_timeout(2_000)
        before = await page.evaluate(INBOUND_JS)
        start = await say_in_ui(ap, " ".join(["word"] * WORDS))
        await page.wait_for_function(
            f"() => window.voiceAgent.events.slice({start}).some(e => e.type === 'speech.ended')",
            timeout=30_000,
        )
        await page.wait_for_timeout(500)  # the jitter buffer's tail
        after = await page.evaluate(INBOUND_JS)
        await page.wait_for_timeout(1_200)  # one more stats sample of the page
        page_stats = await page.evaluate("() => window.voiceAgent.stats")
        server_events = await page.evaluate("() => window.voiceAgent.serverStats")
        peers = app[SESSIONS].peers()
        assert len(peers) == 1
        session_stats = peers[0].session.stats()
        await context.close()
    return {
        "concealed": after["concealedSamples"] - before["concealedSamples"],
        "received": after["totalSamplesReceived"] - before["totalSamplesReceived"],
        "lost": after["packetsLost"] - before["packetsLost"],
        "page": page_stats,
        "server_events": server_events,
        "session": session_stats,
        "dropped": relay.downstream.rtp_dropped,
    }


async def test_bitrate_falls_and_chromium_conceals_less_under_ten_percent_loss() -> None:
    if not HAVE_CHROMIUM:
        if REQUIRE_BROWSER:
            pytest.fail(f"Chromium not found at {CHROMIUM}")
        pytest.skip(f"Chromium not found at {CHROMIUM}")
    args = [*CHROMIUM_ARGS, "--disable-features=WebRtcHideLocalIpsWithMdns"]
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            off = await one_call(browser, adaptive=False)
            on = await one_call(browser, adaptive=True)
        finally:
            await browser.close()
    summary = {
        k: {x: v[x] for x in ("concealed", "received", "lost", "dropped")}
        for k, v in (("off", off), ("on", on))
    }
    print("\nChromium under 10% loss:", summary)
    assert on["dropped"] > 0 and off["dropped"] > 0
    assert on["lost"] > 0 and off["lost"] > 0, summary

    # The page shows the server's bitrate falling (its `stats` events, plotted beside
    # getStats), and FEC on; with the controller off it stays at the ceiling.
    on_rates = [s["serverBitrateKbps"] for s in on["page"] if s.get("serverBitrateKbps")]
    assert on_rates and min(on_rates) < CEILING / 1000, on_rates
    assert any(e["fec"] for e in on["server_events"]), on["server_events"][-3:]
    assert on["session"]["transport_cc"], on["session"]  # Chromium's feedback drove it
    assert on["session"]["send_path"] == "direct", on["session"]  # on the lean send path
    off_rates = {s["serverBitrateKbps"] for s in off["page"] if s.get("serverBitrateKbps")}
    assert off_rates == {CEILING / 1000}, off_rates
    # The received bitrate (getStats) falls below the fixed run's too.
    on_kbps = [s["bitrateKbps"] for s in on["page"][-8:] if s.get("bitrateKbps")]
    assert on_kbps and min(on_kbps) < CEILING / 1000, on_kbps

    # Chromium conceals less with the controller: FEC rebuilds most lost frames.
    assert on["concealed"] < off["concealed"], summary
