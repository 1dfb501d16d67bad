"""GET /metrics: Prometheus text from the app's own registry, through the real server."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client.parser import text_string_to_metric_families

from agent.config import Config, RoomSettings, SecuritySettings
from agent.engine import EngineLoadError
from agent.governor import ComplexityGovernor
from signaling.app import build_app
from signaling.cli import build_parser, config_from_args
from signaling.errors import ApiError
from signaling.keys import CONFIG, SESSIONS
from signaling.metrics import Metrics, _governor_metrics
from signaling.rooms import RoomRegistry
from signaling.routes import check_metrics_token
from signaling.sessions import Peer
from tests.conftest import LiveServer, raw_http, raw_status, serve
from tests.doubles import ToneEngine
from tests.rtc_client import RtcClient

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: aiohttp.ClientSession, url: str, **kwargs: object) -> Samples:
    async with http.get(url + "/metrics", **kwargs) as resp:  # type: ignore[arg-type]
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_follow_sessions_offers_and_speech(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        before = await scrape(http, live_server.url)
        assert value(before, "voice_agent_engine_ready") == 1
        assert value(before, "voice_agent_sessions_max") == live_server.config.limits.max_sessions
        assert value(before, "voice_agent_sessions_active", kind="offer") == 0

        async with http.post(live_server.url + "/offer", json={"type": "offer"}) as resp:
            assert resp.status == 400
        offer = RtcClient(live_server.url, http)
        await offer.connect()
        listener = RtcClient(live_server.url, http)
        await listener.connect(whep=True)
        try:
            offer.send({"type": "say", "text": "one two three", "id": "m"})
            await offer.wait_event(lambda e: e["type"] == "speech.ended")
            during = await scrape(http, live_server.url)
            assert value(during, "voice_agent_sessions_active", kind="offer") == 1
            assert value(during, "voice_agent_sessions_active", kind="whep") == 1
            offers = "voice_agent_offers_total"
            assert value(during, offers, kind="offer", outcome="answered") == 1
            assert value(during, offers, kind="offer", outcome="rejected_bad_sdp") == 1
            assert value(during, offers, kind="whep", outcome="answered") == 1
            assert value(during, "voice_agent_first_audio_seconds_count") == 1
            assert 0 < value(during, "voice_agent_first_audio_seconds_sum") < 5
            assert value(during, "voice_agent_speech_packets_sent_total") > 0
            assert value(during, "voice_agent_queued_utterances") == 0
            bitrate = live_server.config.opus.bitrate
            assert value(during, "voice_agent_session_stat", stat="bitrate", agg="mean") == bitrate
            assert value(during, "voice_agent_session_stat", stat="bitrate", agg="max") == bitrate
            # The CPU governor's view: the complexity every encoder has now, its moves, load.
            # (The governor's probe runs meanwhile: its figures can move after the scrape.)
            governor = live_server.app[SESSIONS].governor
            rungs = governor.policy.rungs
            assert value(during, "voice_agent_opus_complexity") in {r.complexity for r in rungs}
            assert value(during, "voice_agent_opus_band_cap_hertz") in (0, 16000, 12000)  # below
            down = value(during, "voice_agent_opus_complexity_steps_total", direction="down")
            assert down <= governor.policy.steps_down
            assert 0 < value(during, "voice_agent_loop_load") < 1.5
        finally:
            await offer.close()
            await listener.close()
        for client in (offer, listener):
            async with http.delete(f"{live_server.url}/sessions/{client.session_id}") as resp:
                assert resp.status in (204, 404)  # 404: it closed itself already
        after = await scrape(http, live_server.url)
        assert value(after, "voice_agent_sessions_active", kind="offer") == 0
        # Counters keep what closed sessions sent: they never go down.
        for name in ("voice_agent_packets_sent_total", "voice_agent_speech_packets_sent_total"):
            assert value(after, name) >= value(during, name) > 0
        assert ("voice_agent_session_stat", (("agg", "mean"), ("stat", "bitrate"))) not in after


async def test_a_rooms_agent_is_measured_for_first_audio(live_server: LiveServer) -> None:
    """The room's agent speaks through its own pipeline, which was built without the
    server's first-audio hook: no room utterance ever reached the histogram."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect(room="lobby")
        try:
            client.send({"type": "say", "text": "one two three", "id": "m"})
            await client.wait_event(lambda e: e["type"] == "speech.started")
            samples = await scrape(http, live_server.url)
        finally:
            await client.close()
    assert value(samples, "voice_agent_first_audio_seconds_count") == 1
    assert 0 < value(samples, "voice_agent_first_audio_seconds_sum") < 5


async def test_a_rooms_underruns_and_late_ticks_count_once_and_outlive_the_room() -> None:
    """A room's agent (its playout buffer, its paced track) is shared by its participants:
    its underruns and late ticks were counted for none of them, so never. Now once per
    room, and kept when the room closes with its last participant."""
    metrics = Metrics(ToneEngine(), 10)
    registry = RoomRegistry(Config(), ToneEngine(), on_closed=metrics.retire_room)
    options = {"speaking": False, "host": True, "display_name": None, "hooks": None}
    members = [registry.join("r", f"s{i}", expects_channel=False, **options) for i in (1, 2)]
    room = members[0].room
    peers = [Peer(None, member, "whep", room="r") for member in members]  # type: ignore[arg-type]
    metrics.watch(lambda: list(peers), rooms=registry.rooms)
    room.pipeline.buffer.underruns = 3
    room.agent_track.stats.late_rephases = 2

    def counted() -> tuple[float, float]:
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples
        }
        return samples["voice_agent_underruns_total"], samples["voice_agent_late_packets_total"]

    try:
        assert counted() == (3, 2)  # two participants, one room
        for peer, member in zip(list(peers), members, strict=True):
            peers.remove(peer)  # as the registry does: out of it, then retired, then closed
            metrics.retire(peer)
            await member.close()
            assert counted() == (3, 2)
        assert registry.get("r") is None  # closed with its last participant, counts kept
    finally:
        for member in members:
            await member.close()


def test_every_app_has_its_own_registry() -> None:
    first = build_app(Config(), ToneEngine())
    second = build_app(Config(), ToneEngine())  # no "duplicated timeseries" error
    assert first is not second


class TestProtected:
    @pytest.fixture
    def server_config(self) -> Config:
        return Config(
            host="127.0.0.1",
            security=SecuritySettings(auth_secret="s" * 32, metrics_token="metrics-token"),
        )

    async def test_a_metrics_token_protects_metrics_and_refusals_are_counted(
        self, live_server: LiveServer
    ) -> None:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with http.get(live_server.url + "/metrics", headers=headers) as resp:
                    assert resp.status == 401
                    assert (await resp.json())["error"]["code"] == "unauthorized"
            async with http.post(live_server.url + "/offer", json={"type": "offer"}) as resp:
                assert resp.status == 401
            samples = await scrape(
                http, live_server.url, headers={"Authorization": "Bearer metrics-token"}
            )
            outcome = "rejected_unauthorized"
            assert value(samples, "voice_agent_offers_total", kind="offer", outcome=outcome) == 1

    async def test_a_bearer_that_is_not_utf8_is_refused_not_a_crash(
        self, live_server: LiveServer
    ) -> None:
        # aiohttp hands the header's 0xff byte over as a lone surrogate: .encode() raised.
        reply = await raw_http(
            live_server.url,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\r\n"
            b"Connection: close\r\n\r\n",
        )
        assert raw_status(reply) == 401, reply
        assert b'"unauthorized"' in reply


@pytest.mark.parametrize("raw", ["s3cret\n", "s3cret ", " s3cret\r\n"])
def test_a_metrics_token_read_from_a_file_can_be_presented(raw: str) -> None:
    """VOICE_AGENT_METRICS_TOKEN was kept with its newline (a secret mounted from a file) or
    trailing space, while the token presented loses its own (a header cannot keep it): no
    scrape could ever match. Variables are stripped now, secrets included."""
    env = {"VOICE_AGENT_METRICS_TOKEN": raw}
    app = web.Application()
    app[CONFIG] = config_from_args(build_parser(env).parse_args(["serve"]), env)
    for presented, allowed in (("s3cret", True), (raw, True), ("s3cre", False)):
        request = make_mocked_request(
            "GET", "/metrics", headers={"Authorization": f"Bearer {presented.strip()}"}, app=app
        )
        if allowed:
            check_metrics_token(request)
        else:
            with pytest.raises(ApiError):
                check_metrics_token(request)


async def test_scraping_reads_live_state_without_a_background_task(
    live_server: LiveServer,
) -> None:
    """Engine state is read at scrape time: no task keeps gauges up to date."""
    async with aiohttp.ClientSession() as http:
        assert value(await scrape(http, live_server.url), "voice_agent_engine_ready") == 1
        await live_server.engine.close()
        assert value(await scrape(http, live_server.url), "voice_agent_engine_ready") == 0


def test_the_band_cap_gauge_follows_the_governors_rung() -> None:
    governor = ComplexityGovernor(9, 0)
    try:

        def band_cap() -> float:
            families = {m.name: m for m in _governor_metrics(governor)}
            return families["voice_agent_opus_band_cap_hertz"].samples[0].value

        assert band_cap() == 0
        for t in (0.0, 1.0, 2.0):  # overloaded: 7, 6, then wide-band 6
            governor.policy.decide(t, 1.0, 0.0)
        assert str(governor.rung) == "wb6" and band_cap() == 16000
        for t in (3.0, 4.0):  # wide-band 2, then medium-band 0
            governor.policy.decide(t, 1.0, 0.0)
        assert str(governor.rung) == "mb0" and band_cap() == 12000
    finally:
        governor.close()


@pytest.mark.parametrize("direct_send", [True, False], ids=["direct", "aiortc-sender"])
async def test_a_rooms_speech_is_counted_for_each_participant(direct_send: bool) -> None:
    """voice_agent_speech_packets_sent_total counts the RTP packets that carried speech: in
    a room, each participant's share of the agent's speech, as a 1:1 peer's. It stayed at 0
    for rooms whatever their agents said (the fan-out counted packets, never speech; found
    by review), on either send path."""
    cfg = Config(host="127.0.0.1", port=0, rooms=RoomSettings(direct_send=direct_send))
    async with serve(cfg, ToneEngine()) as server, aiohttp.ClientSession() as http:
        client = RtcClient(server.url, http)
        try:
            await client.connect(room="m", slots=1)
            before = await scrape(http, server.url)
            client.send({"type": "say", "text": "one two three four", "id": "u"})
            await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=15)
            after = await scrape(http, server.url)
        finally:
            await client.close()
    sent = value(after, "voice_agent_packets_sent_total") - value(
        before, "voice_agent_packets_sent_total"
    )
    speech = value(after, "voice_agent_speech_packets_sent_total") - value(
        before, "voice_agent_speech_packets_sent_total"
    )
    # Four words of the tone engine: 1 s of speech, 50 packets, sent to the one participant.
    assert 45 <= speech <= 55 and speech <= sent, (speech, sent)


class _EngineThatCannotLoad(ToneEngine):
    async def start(self) -> None:
        raise EngineLoadError("could not download the model: pass --model-dir")


async def _samples(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


@pytest.mark.parametrize("tone_engine", [_EngineThatCannotLoad()])
async def test_an_engine_that_failed_to_load_shows_as_failed_in_the_metrics(
    live_server: LiveServer,
) -> None:
    """README: /readyz and every offer answer 503 ``engine_failed`` when "the model could not
    load" (no network: use --model-dir), and /metrics has ``voice_agent_engine_failed`` 0/1.
    An operator alerting on it never hears of the commonest failure: the gauge stays 0 and
    ``voice_agent_engine_ready`` 0, which reads as a model still loading, for ever (found
    by review)."""
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(5):
            while True:  # the load runs in the background
                async with http.get(live_server.url + "/readyz") as resp:
                    body = await resp.json()
                if body.get("error", {}).get("code") == "engine_failed":
                    break
                await asyncio.sleep(0.02)
        samples = await _samples(http, live_server.url)
    assert samples["voice_agent_engine_ready"] == 0
    assert samples["voice_agent_engine_failed"] == 1, "readyz says engine_failed"
