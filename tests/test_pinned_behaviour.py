"""Documented behaviour no other test held: each test here was written against a small
mutation of the product code that the whole suite let pass (a mutation-testing review)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest

from agent.config import Config, SecuritySettings, SpeechSettings
from agent.conversation_config import ListenSettings, ServiceSettings
from tests.conftest import LiveServer

# --- signaling/routes.py ------------------------------------------------------------------


@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", port=0, speech=SpeechSettings(max_queued_utterances=1))],
)
async def test_say_answers_queue_full_with_429_and_counts_as_use(live_server: LiveServer) -> None:
    """README: ``queue_full`` is a 429 (a client backs off and retries), not a 400 (a client
    error it should not retry). And a ``say`` is a client request: it keeps the session from
    its idle timeout (lifecycle: "no client request and no speech for idle_timeout_s")."""
    from signaling.keys import SESSIONS
    from tests.rtc_client import RtcClient

    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            assert client.session_id is not None
            peer = live_server.app[SESSIONS].get(client.session_id)
            peer.life.last_activity = 0.0  # long idle
            url = f"{live_server.url}/sessions/{client.session_id}/say"
            statuses: list[tuple[int, str | None]] = []
            for _ in range(4):
                async with http.post(url, json={"text": "Hello there, how are you?"}) as resp:
                    body = await resp.json()
                    statuses.append((resp.status, body.get("error", {}).get("code")))
            assert statuses[0] == (202, None)
            assert (429, "queue_full") in statuses, statuses
            assert all(s in ((202, None), (429, "queue_full")) for s in statuses), statuses
            assert peer.life.last_activity > time.monotonic() - 60  # the say counted as use
        finally:
            await client.close()


def test_metrics_token_must_come_as_a_bearer_token() -> None:
    """``Authorization: Bearer <token>`` (README); the same secret under another scheme
    (Basic, a typo'd header) is refused."""
    from signaling.errors import ApiError
    from signaling.keys import CONFIG
    from signaling.routes import check_metrics_token

    config = Config(security=SecuritySettings(metrics_token="s3cret"))

    def request(header: str) -> Any:
        return SimpleNamespace(app={CONFIG: config}, headers={"Authorization": header})

    check_metrics_token(request("Bearer s3cret"))
    check_metrics_token(request("bearer s3cret"))
    for bad in ("Basic s3cret", "Token s3cret", "Bearer wrong", "s3cret"):
        with pytest.raises(ApiError) as err:
            check_metrics_token(request(bad))
        assert err.value.status == 401, bad


def test_readyz_waits_for_the_voice_activity_model() -> None:
    """README: /readyz is 200 once the speech model is loaded "and, unless --no-listen, the
    voice activity model": a balancer must not send calls while loading it stalls the loop."""
    from signaling.keys import BREAKER, DRAIN, SESSIONS
    from signaling.routes import _readiness_refusal

    app: dict[Any, Any] = {
        DRAIN: SimpleNamespace(draining=False),
        BREAKER: SimpleNamespace(unavailable=None),
        SESSIONS: SimpleNamespace(listening_ready=False),
    }
    engine = SimpleNamespace(ready=True)
    refusal = _readiness_refusal(app, engine)  # type: ignore[arg-type]
    assert refusal is not None and refusal.status == 503 and refusal.code == "not_ready"
    app[SESSIONS].listening_ready = True
    assert _readiness_refusal(app, engine) is None  # type: ignore[arg-type]


# --- agent/config.py (documented default) ------------------------------------------------


def test_a_text_stream_times_out_after_30_seconds_by_default() -> None:
    """README: ``stream_timeout``: "it had no delta for 30 s and was ended"."""
    assert SpeechSettings().stream_idle_timeout_s == 30.0


# --- signaling/sessions.py -----------------------------------------------------------------


async def test_the_watchdog_leaves_a_session_being_resumed_alone() -> None:
    """A resume negotiating a new connection (ICE gathering takes seconds) must not have its
    session expired under it by the watchdog, however long ago the peer was lost."""
    from signaling.lifecycle import Liveness
    from signaling.sessions import Peer, SessionRegistry
    from tests.doubles import ToneEngine

    registry = SessionRegistry(Config(), ToneEngine())
    closed: list[str] = []

    async def close() -> None:
        closed.append("session")

    session = SimpleNamespace(
        id="s1",
        pipeline=SimpleNamespace(sounding=False),
        conversation=SimpleNamespace(user_heard_at=lambda now: -1e9),
        close=close,
    )
    life = Liveness(detached_at=time.monotonic() - 10_000)  # far past the resume grace
    peer = Peer(SimpleNamespace(connectionState="closed"), session, "offer", life=life)  # type: ignore[arg-type]
    peer.resuming = True
    registry._peers["s1"] = peer
    try:
        registry._check_all()
        for _ in range(5):
            await asyncio.sleep(0)
        assert "s1" in registry._peers and not closed
    finally:
        registry._peers.pop("s1", None)
        for task in list(registry._closing):
            task.cancel()
        await asyncio.gather(*registry._closing, return_exceptions=True)
        await registry.close_all()


# --- agent/turns.py ------------------------------------------------------------------------


async def test_closing_a_conversation_closes_its_http_client() -> None:
    """The STT/LLM connections of a session go with it (an unclosed aiohttp session leaks
    its connector's sockets and logs "Unclosed client session")."""
    from agent.session import AgentSession
    from tests.doubles import ToneEngine

    config = Config(services=ServiceSettings(llm_base_url="http://127.0.0.1:9/v1"))
    session = AgentSession("s", ToneEngine(), config)
    conversation = session.conversation
    http = conversation._client()
    await session.close()
    assert http.closed


# --- agent/inbound.py ----------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.started: list[Any] = []
        self.ended: list[Any] = []

    def user_started(self, event: Any) -> None:
        self.started.append(event)

    def user_ended(self, audio: Any, event: Any) -> None:
        self.ended.append((audio, event))


class _Frames:
    """A microphone track delivering ``n`` frames, then ending."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent = 0

    async def recv(self) -> Any:
        from aiortc.mediastreams import MediaStreamError

        if self.sent == self.n:
            raise MediaStreamError
        self.sent += 1
        return self.sent


async def test_a_scorer_that_falls_behind_loses_the_oldest_windows() -> None:
    """Module docstring: "If scoring falls behind, the oldest windows are dropped": what is
    scored next is the newest audio (a barge-in heard late is worse than one missing a
    little of its past)."""
    from agent.inbound import InboundAudio

    settings = ListenSettings(max_pending_windows=3)
    inbound = InboundAudio(_Frames(8), None, settings, _Recorder())  # type: ignore[arg-type]
    inbound._windows = lambda frame: [np.full(512, frame, np.float32)]  # type: ignore[method-assign]
    inbound._gap_windows = lambda frame: []  # type: ignore[method-assign]
    await inbound._read()
    kept = []
    while not inbound._queue.empty():
        window, _ = inbound._queue.get_nowait()
        kept.append(int(window[0]))
    assert kept == [6, 7, 8]
    assert inbound.stats.dropped_windows == 5


def _speaking(settings: ListenSettings, heard: Any = None) -> tuple[Any, _Recorder]:
    from agent.inbound import InboundAudio

    listener = _Recorder()
    inbound = InboundAudio(None, None, settings, listener, heard=heard)  # type: ignore[arg-type]
    for i in range(6):
        inbound._on_window(np.zeros(512, np.float32), float(i), 0.9)
    assert inbound.detector.speaking and listener.started
    return inbound, listener


async def test_a_short_gap_in_the_microphone_does_not_end_a_turn() -> None:
    """No frame for less than QUIET_ENDS_TURN_MIN_S is the network's jitter or a stalled
    loop, even where the end-of-turn silence is shorter: the turn goes on."""
    from agent.inbound import QUIET_ENDS_TURN_MIN_S

    settings = ListenSettings(min_speech_ms=64, end_of_turn_silence_ms=64)
    inbound, listener = _speaking(settings)
    inbound._last_frame_at = time.monotonic()
    watch = asyncio.get_running_loop().create_task(inbound._watch_quiet())
    try:
        await asyncio.sleep(QUIET_ENDS_TURN_MIN_S * 0.6)
        assert not listener.ended and inbound.detector.speaking
        await asyncio.sleep(QUIET_ENDS_TURN_MIN_S * 0.9)
        assert len(listener.ended) == 1  # a real quiet does end it
    finally:
        watch.cancel()


async def test_the_quiet_watch_waits_for_windows_still_to_be_scored() -> None:
    """Windows still queued for the scorer may hold the turn's own end (or, behind, its
    onset): the quiet-microphone watch leaves the turn to them."""
    from agent.inbound import QUIET_ENDS_TURN_MIN_S

    settings = ListenSettings(min_speech_ms=64, end_of_turn_silence_ms=64)
    inbound, listener = _speaking(settings)
    inbound._queue.put_nowait((np.zeros(512, np.float32), 0.0))
    inbound._last_frame_at = time.monotonic() - 10 * QUIET_ENDS_TURN_MIN_S
    watch = asyncio.get_running_loop().create_task(inbound._watch_quiet())
    try:
        await asyncio.sleep(0.05)
        assert not listener.ended and inbound.detector.speaking
    finally:
        watch.cancel()


# --- agent/adaptation.py -------------------------------------------------------------------


def test_transport_cc_records_each_packets_own_size() -> None:
    """The send history behind transport-cc's receive rate gets each packet's own size
    (the bytes since the packet before), not the stream's running total: the total made
    the receive rate, and so the congestion backoff's cap, grow without bound."""
    from agent.adaptation import NetworkAdaptation, ReceiverOpus
    from agent.config import AdaptationSettings
    from agent.playout import PlayoutBuffer
    from agent.track import OpusPacketTrack

    async def ignore(*_: Any) -> None:
        return None

    sender = SimpleNamespace(
        _handle_rtcp_packet=ignore,
        _send_rtcp=ignore,
        transport=SimpleNamespace(_handle_rtcp_data=ignore),
        _ssrc=1,
    )
    track = OpusPacketTrack(PlayoutBuffer(10, 48_000))
    try:
        network = NetworkAdaptation(
            track, AdaptationSettings(), ReceiverOpus(fec=True, transport_cc=True)
        )
        network.attach(sender)  # type: ignore[arg-type]
        assert network.tap is not None
        size = network.tap._packet_size
        track.stats.bytes = 100
        assert size() == 100
        track.stats.bytes = 160
        assert size() == 60
        track.stats.bytes = 230
        assert size() == 70
    finally:
        track.stop()
