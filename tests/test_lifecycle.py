"""Session lifecycle through the real server: connect timeout, vanished peers, idle sessions.

Timeouts are shortened so each test takes seconds; the rules are the product's
(signaling/lifecycle.py). Vanishing clients are made with the lossy relay (tests/netem.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from agent.config import Config, LifecycleSettings
from signaling.keys import SESSIONS
from signaling.lifecycle import Liveness, Verdict, check_interval, tap_rtcp, verdict
from tests.clips import SPEECH_WAV, read_wav
from tests.conftest import LiveServer
from tests.mic import ClipMic
from tests.netem import relayed_client
from tests.rtc_client import RtcClient

pytestmark = pytest.mark.timeout(60)

SHORT = LifecycleSettings(
    connect_timeout_s=1.5, rtcp_timeout_s=2.0, resume_grace_s=1.0, idle_timeout_s=0
)


@pytest.fixture
def server_config() -> Config:
    return Config(host="127.0.0.1", port=0, lifecycle=SHORT)


async def session_state(http: aiohttp.ClientSession, url: str, sid: str) -> dict[str, Any] | None:
    async with http.get(f"{url}/sessions/{sid}") as resp:
        if resp.status == 404:
            return None
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


async def wait_for(
    http: aiohttp.ClientSession,
    url: str,
    sid: str,
    predicate: Any,
    timeout: float,
) -> float:
    """Seconds until the session's state (None once it is gone) satisfies ``predicate``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate(await session_state(http, url, sid)):
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    now = await session_state(http, url, sid)
    raise TimeoutError(f"session {sid} never reached the state; now {now}")


def gone(state: dict[str, Any] | None) -> bool:
    return state is None


def detached(state: dict[str, Any] | None) -> bool:
    return state is not None and state["detached"]


def test_default_timers_clean_up_a_vanished_client_within_30_s() -> None:
    life = LifecycleSettings()
    # Worst case: last RTCP just before it vanished, then the grace, plus one watchdog tick.
    assert life.rtcp_timeout_s + life.resume_grace_s + 1.0 <= 30
    assert 10 <= life.connect_timeout_s <= 30


@contextlib.asynccontextmanager
async def unanswered_session(url: str) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """A session made by a real offer whose answer the client never applies (it stays
    away): an HTTP client and the session id."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    try:
        async with aiohttp.ClientSession() as http:
            offer = {"type": "offer", "sdp": pc.localDescription.sdp}
            async with http.post(url + "/offer", json=offer) as resp:
                assert resp.status == 200, await resp.text()
                sid = (await resp.json())["session_id"]
            yield http, sid
    finally:
        await pc.close()


async def test_a_peer_that_never_connects_is_closed(live_server: LiveServer) -> None:
    async with unanswered_session(live_server.url) as (http, sid):
        # The answer is never applied: ICE never completes.
        elapsed = await wait_for(http, live_server.url, sid, gone, 10)
    assert SHORT.connect_timeout_s - 0.1 <= elapsed <= SHORT.connect_timeout_s + 1.5
    assert len(live_server.app[SESSIONS]) == 0


@pytest.mark.parametrize("how", ["loss", "blackout"])
async def test_a_client_that_vanishes_is_cleaned_up(live_server: LiveServer, how: str) -> None:
    """100% loss both ways with RTCP (STUN and DTLS still pass, so ICE consent holds), or
    a blackout (nothing passes): either way the session is detached after the RTCP timeout
    and closed after the grace."""
    async with (
        aiohttp.ClientSession() as http,
        relayed_client(live_server.url, http) as (
            client,
            relay,
        ),
    ):
        sid = client.session_id
        assert sid is not None
        await asyncio.sleep(0.5)
        state = await session_state(http, live_server.url, sid)
        assert state is not None and state["connection"] == "connected"
        if how == "loss":
            relay.set_drop_rtcp(True)
            relay.set_loss(downstream=1.0, upstream=1.0)
        else:
            relay.blackout = True
        lost = await wait_for(http, live_server.url, sid, detached, 10)
        closed = await wait_for(http, live_server.url, sid, gone, 10) + lost
    # The last report came up to ~1.5 s before the cut (aiortc reports every 0.5-1.5 s).
    assert SHORT.rtcp_timeout_s - 1.6 <= lost <= SHORT.rtcp_timeout_s + 1.5
    assert closed <= SHORT.rtcp_timeout_s + SHORT.resume_grace_s + 2.0
    assert len(live_server.app[SESSIONS]) == 0


async def test_a_client_that_closes_without_a_goodbye_is_cleaned_up(
    live_server: LiveServer,
) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        sid = client.session_id
        assert sid is not None
        await asyncio.sleep(0.3)
        await client.close()  # no DELETE
        # DTLS close_notify reaches the server: it notices at once, not after the timeout.
        lost = await wait_for(http, live_server.url, sid, detached, 5)
        closed = await wait_for(http, live_server.url, sid, gone, 5) + lost
    assert lost < SHORT.rtcp_timeout_s
    assert closed <= lost + SHORT.resume_grace_s + 1.0


@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", port=0, lifecycle=LifecycleSettings(idle_timeout_s=1.5))],
)
async def test_an_idle_session_is_closed_and_told_why(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        sid = client.session_id
        assert sid is not None
        try:
            # Activity keeps it: a short utterance at 1 s pushes the deadline back.
            await asyncio.sleep(1.0)
            client.send({"type": "say", "text": "one two", "id": "u1"})
            await client.wait_event(lambda e: e["type"] == "speech.ended")
            started = time.monotonic()
            event = await client.wait_event(lambda e: e["type"] == "session.closed", 5)
            idle_for = time.monotonic() - started
            assert event == {"type": "session.closed", "reason": "idle_timeout"}
            await wait_for(http, live_server.url, sid, gone, 3)
        finally:
            await client.close()
    assert 1.0 <= idle_for <= 3.0


@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", port=0, lifecycle=LifecycleSettings(idle_timeout_s=1.5))],
)
async def test_a_session_whose_check_fails_neither_stops_the_others_nor_lives_on(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog caught an exception around its whole pass: one session whose check
    raised stopped every later session's check, every tick, and itself was never closed
    (found by review). Each session is now checked on its own; one that fails is closed."""
    import signaling.sessions

    async with aiohttp.ClientSession() as http:
        broken, idle = RtcClient(live_server.url, http), RtcClient(live_server.url, http)
        await broken.connect()
        await idle.connect()
        real_verdict = signaling.sessions.verdict
        broken_life = live_server.app[SESSIONS].get(broken.session_id).life

        def failing_verdict(life: Liveness, *args: Any) -> Verdict | None:
            if life is broken_life:
                raise RuntimeError("a check that fails")
            return real_verdict(life, *args)

        # The broken one first in the registry: the pass used to stop there.
        monkeypatch.setattr(signaling.sessions, "verdict", failing_verdict)
        try:
            await wait_for(http, live_server.url, broken.session_id, gone, 3)
            event = await idle.wait_event(lambda e: e["type"] == "session.closed", 5)
            assert event["reason"] == "idle_timeout"
        finally:
            await idle.close()
            await broken.close()


@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", port=0, lifecycle=LifecycleSettings(idle_timeout_s=2.0))],
)
async def test_the_user_talking_keeps_a_session_from_the_idle_timeout(
    live_server: LiveServer,
) -> None:
    """Bug: in a one-to-one session the user's own speech never counted as activity (in a
    room anyone's does): a user talking to an agent that stayed silent (no STT, or still
    thinking) had the session closed under them as an abandoned tab. Once they go quiet the
    idle timeout runs again."""
    samples, rate = read_wav(SPEECH_WAV)  # 3.5 s of speech, longer than the idle timeout
    keep_alive = {"type": "config", "barge_in": True}  # a client request: activity
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        mic = client.mic = ClipMic()
        await client.connect()
        sid = client.session_id
        assert sid is not None
        try:
            # Until the microphone is scored, requests keep the session (as at a call's start).
            deadline = time.monotonic() + 30
            while True:
                client.send(keep_alive)
                state = await session_state(http, live_server.url, sid)
                inbound = state and state["inbound"]
                if inbound and inbound["ready"] and inbound["windows"] > 5:
                    break
                assert time.monotonic() < deadline, state
                await asyncio.sleep(0.1)
            client.send(keep_alive)  # the last request: from here only the user talks
            mic.play(samples, rate)
            talked = time.monotonic()
            while not mic.done.is_set():
                closed = [e for e in client.events if e["type"] == "session.closed"]
                assert not closed, f"closed {time.monotonic() - talked:.1f} s into the talk"
                assert time.monotonic() - talked < 10
                await asyncio.sleep(0.05)
            quiet_from = time.monotonic()
            assert any(e["type"] == "user.speech.started" for e in client.events)
            event = await client.wait_event(lambda e: e["type"] == "session.closed", 8)
            quiet_for = time.monotonic() - quiet_from
            assert event == {"type": "session.closed", "reason": "idle_timeout"}
        finally:
            await client.close()
    # The end of the turn (0.6 s of silence) plus the idle timeout, give or take a look.
    assert 1.5 <= quiet_for <= 5.0, quiet_for


# --- the rules alone (verdict is a pure function of the liveness and the clock) ------------
RULES = LifecycleSettings(
    connect_timeout_s=20.0, rtcp_timeout_s=12.0, resume_grace_s=15.0, idle_timeout_s=600.0
)


def _life(**fields: Any) -> Liveness:
    life = Liveness(created_at=0.0, last_activity=0.0)
    for name, value in fields.items():
        setattr(life, name, value)
    return life


def test_a_detached_session_expires_when_its_grace_is_up() -> None:
    life = _life(connected_at=1.0, detached_at=100.0)
    assert verdict(life, False, RULES, 114.9) is Verdict.KEEP
    assert verdict(life, False, RULES, 115.0) is Verdict.EXPIRED


def test_a_timer_of_zero_is_off() -> None:
    """0 turns a timer off (LifecycleSettings): no idle close, no connect timeout, no RTCP
    timeout, however long it has been."""
    off = LifecycleSettings(
        connect_timeout_s=0, rtcp_timeout_s=0, resume_grace_s=15.0, idle_timeout_s=0
    )
    assert verdict(_life(), False, off, 10_000.0) is Verdict.KEEP  # never connected
    connected = _life(connected_at=1.0, last_inbound=1.0)
    assert verdict(connected, True, off, 10_000.0) is Verdict.KEEP  # silent peer


def test_a_peer_that_lost_its_connection_runs_the_connect_timer() -> None:
    """Connected once but not now (ICE reconnecting): the connect timer decides, even while
    RTCP was heard recently."""
    life = _life(connected_at=1.0, last_inbound=19.0, last_activity=19.0)
    assert verdict(life, True, RULES, 20.0) is Verdict.KEEP
    assert verdict(life, False, RULES, 20.0) is Verdict.LOST
    assert life.lost_reason == "connect_timeout"


def test_the_watchdog_looks_four_times_per_shortest_timer() -> None:
    short = LifecycleSettings(
        connect_timeout_s=2.0, rtcp_timeout_s=3.0, resume_grace_s=0, idle_timeout_s=0
    )
    assert check_interval(short) == 0.5
    assert check_interval(RULES) == 1.0


def test_liveness_keeps_the_first_connect_and_never_moves_activity_back() -> None:
    life = Liveness()
    life.connected()
    first = life.connected_at
    life.connected()  # a reconnect
    assert life.connected_at == first
    life.active()
    latest = life.last_activity
    life.active_since(latest - 100.0)  # an older speech time: no step back
    assert life.last_activity == latest


async def test_tap_rtcp_sees_every_rtcp_packet_and_passes_it_on() -> None:
    from tests.doubles import RtcpSender

    sender = RtcpSender()
    passed: list[object] = []

    async def original(packet: object) -> None:
        passed.append(packet)

    sender._handle_rtcp_packet = original  # type: ignore[method-assign]
    heard: list[int] = []
    tap_rtcp(sender, lambda: heard.append(1))  # type: ignore[arg-type]
    await sender._handle_rtcp_packet("rr")
    assert heard == [1] and passed == ["rr"]


RESUMED_IDLE = LifecycleSettings(
    connect_timeout_s=5, rtcp_timeout_s=3.0, resume_grace_s=5.0, idle_timeout_s=4.0
)


@pytest.mark.parametrize(
    "server_config", [Config(host="127.0.0.1", port=0, lifecycle=RESUMED_IDLE)]
)
async def test_a_resume_does_not_restart_the_idle_timer(live_server: LiveServer) -> None:
    """Only a client message (data channel, POST say) or speech keeps a session from
    --idle-timeout (README, Idle); a resume is neither, but it started the timer afresh:
    a forgotten tab on a flaky network, resuming by itself, was never closed."""
    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        await first.connect()
        connected = time.monotonic()
        sid = first.session_id
        assert sid is not None
        await asyncio.sleep(2.5)  # nothing sent, nothing said
        await first.close()
        await wait_for(http, live_server.url, sid, detached, 5)
        second = RtcClient(live_server.url, http)
        await second.connect(resume=first.session_token)
        try:
            await wait_for(http, live_server.url, sid, gone, 10)
            idle_for = time.monotonic() - connected
        finally:
            await second.close()
    assert idle_for <= RESUMED_IDLE.idle_timeout_s + 1.5, f"closed after {idle_for:.1f} s of no use"


SLOW_GATHERING_CONNECT = LifecycleSettings(
    connect_timeout_s=2.0, rtcp_timeout_s=0, resume_grace_s=0, idle_timeout_s=0
)
# aioice gathers server-reflexive and relayed candidates for up to 5 s (a STUN/TURN server
# that is slow or silent): the answer waits for that (non-trickle).
GATHERING_S = 2.5


@pytest.mark.parametrize(
    "server_config", [Config(host="127.0.0.1", port=0, lifecycle=SLOW_GATHERING_CONNECT)]
)
async def test_the_connect_timer_runs_from_the_answer_not_from_before_gathering(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README (Lifecycle): a connection not connected --connect-timeout after its answer
    was sent is closed with its session. The timer started before setLocalDescription
    gathered ICE (up to 5 s with a slow STUN/TURN server): the gathering was taken off the
    client's time to connect, and one as long as the timeout closed the session at the
    first watchdog tick after its answer, before any client could have connected."""
    from signaling import sessions

    class SlowGathering(RTCPeerConnection):  # the server's connections only
        async def setLocalDescription(self, description: RTCSessionDescription) -> None:
            await asyncio.sleep(GATHERING_S)
            await super().setLocalDescription(description)

    monkeypatch.setattr(sessions, "RTCPeerConnection", SlowGathering)
    async with unanswered_session(live_server.url) as (http, sid):
        # The answer is never applied (the client stays away): the session must live
        # --connect-timeout from now.
        elapsed = await wait_for(http, live_server.url, sid, gone, 10)
    assert elapsed >= SLOW_GATHERING_CONNECT.connect_timeout_s - 0.2, (
        f"closed {elapsed:.2f} s after its answer (--connect-timeout "
        f"{SLOW_GATHERING_CONNECT.connect_timeout_s} s): the timer ran during ICE gathering"
    )
