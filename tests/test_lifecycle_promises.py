"""Promises of README "Lifecycle: disconnect, reconnect, shutdown" and of its error list that
no other test held the code to (found by hand mutation testing of the session lifecycle)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiortc import RTCPeerConnection

from agent.config import Config, LifecycleSettings
from signaling.keys import SESSIONS
from tests.conftest import LiveServer
from tests.rtc_client import RtcClient
from tests.test_lifecycle import detached, session_state, unanswered_session, wait_for

pytestmark = pytest.mark.timeout(60)

LIFE = LifecycleSettings(connect_timeout_s=5, rtcp_timeout_s=3, resume_grace_s=5, idle_timeout_s=0)


@pytest.fixture
def server_config() -> Config:
    return Config(host="127.0.0.1", port=0, lifecycle=LIFE)


async def _post_resume(http: aiohttp.ClientSession, url: str, token: object) -> tuple[int, Any]:
    client = RtcClient(url, http)
    client.pc.addTransceiver("audio", direction="recvonly")
    client.pc.createDataChannel("agent")
    await client.pc.setLocalDescription(await client.pc.createOffer())
    body = {"type": "offer", "sdp": client.pc.localDescription.sdp, "resume": token}
    try:
        async with http.post(url + "/offer", json=body) as resp:
            return resp.status, await resp.json()
    finally:
        await client.close()


@pytest.mark.parametrize("grace_over", [False, True])
async def test_a_second_resume_while_one_negotiates_gets_409_resume_in_progress(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch, grace_over: bool
) -> None:
    """README errors: ``resume_in_progress`` (409: the same token is being resumed). Two
    resumes of one session at once (a client retrying while ICE gathers) would otherwise
    both renew its track (the first answer's track stopped under it) and leave one of the
    two new peer connections to nobody. ``grace_over``: the retry comes after
    --resume-grace ran out meanwhile: the grace check must not close the session under the
    resume in progress (410 for both; found by mutation testing)."""
    registry = live_server.app[SESSIONS]
    if grace_over:
        registry._check_all = lambda: None  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        await first.connect()
        sid, token = first.session_id, first.session_token
        assert sid is not None and token is not None
        await first.close()
        await wait_for(http, live_server.url, sid, detached, 5)

        real_connect = registry._connect
        made: list[RTCPeerConnection] = []

        async def slow_connect(*args: Any) -> tuple[RTCPeerConnection, str]:
            await asyncio.sleep(1.0)  # ICE gathering against a slow STUN server, say
            pc, answer = await real_connect(*args)
            made.append(pc)
            return pc, answer

        monkeypatch.setattr(registry, "_connect", slow_connect)
        one = asyncio.ensure_future(_post_resume(http, live_server.url, token))
        peer = registry.get(sid)
        deadline = time.monotonic() + 5
        while not peer.resuming:
            assert time.monotonic() < deadline, "the first resume never started"
            await asyncio.sleep(0.01)
        if grace_over:
            grace = registry.config.lifecycle.resume_grace_s
            peer.life.detached_at = time.monotonic() - grace - 0.05
        second = await _post_resume(http, live_server.url, token)
        first_result = await one
    assert first_result[0] == 200, first_result
    assert second[0] == 409 and second[1]["error"]["code"] == "resume_in_progress", second
    assert len(made) == 1, f"{len(made)} peer connections negotiated for one session"


@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", port=0, lifecycle=LifecycleSettings(idle_timeout_s=1.5))],
)
async def test_agent_speech_longer_than_the_idle_timeout_is_not_cut_off(
    live_server: LiveServer,
) -> None:
    """README, Idle: speech (the agent's audio being made or played) is use of the session.
    An utterance longer than --idle-timeout, after the request that asked for it, must play
    to its end and the session stay open while it plays."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            # 16 words of the tone engine: 4 s of speech, more than twice the idle timeout.
            client.send({"type": "say", "text": " ".join(["word"] * 16), "id": "long"})
            ended = await client.wait_event(lambda e: e["type"] == "speech.ended", 15)
            closed = [e for e in client.events if e["type"] == "session.closed"]
            assert not closed, f"closed for idleness while speaking: {client.events}"
            assert ended == {"type": "speech.ended", "id": "long", "interrupted": False}
            # Once quiet, the idle timeout runs again.
            event = await client.wait_event(lambda e: e["type"] == "session.closed", 5)
            assert event == {"type": "session.closed", "reason": "idle_timeout"}
        finally:
            await client.close()


@pytest.mark.parametrize(
    "server_config",
    [
        Config(
            host="127.0.0.1",
            port=0,
            lifecycle=LifecycleSettings(
                connect_timeout_s=1.0, rtcp_timeout_s=2.0, resume_grace_s=10.0, idle_timeout_s=0
            ),
        )
    ],
)
async def test_a_peer_that_never_connected_is_closed_at_its_connect_timeout_not_detached(
    live_server: LiveServer,
) -> None:
    """README: a peer connection that is not connected --connect-timeout after its answer
    was sent is closed with its session. A session that never had a connection has no
    client to come back: it must not wait the resume grace as a detached one, holding a
    --max-sessions seat."""
    async with unanswered_session(live_server.url) as (http, sid):
        seen_detached = False
        start = time.monotonic()
        while time.monotonic() - start < 4.0:
            state = await session_state(http, live_server.url, sid)
            if state is None:
                break
            seen_detached = seen_detached or state["detached"]
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - start
        assert not seen_detached, "a never-connected session was detached for a resume"
        assert await session_state(http, live_server.url, sid) is None, (
            f"still there {elapsed:.1f} s after its answer (connect timeout 1 s)"
        )
    assert len(live_server.app[SESSIONS]) == 0


async def test_a_vanished_peer_s_connection_is_closed_and_its_playout_paused(
    live_server: LiveServer,
) -> None:
    """README: a lost peer's connection is closed at once and its session detached; while
    detached its playout pauses (nothing takes frames from the playout buffer), so queued
    speech waits for the resume. A client that vanished (blackout, noticed by the RTCP
    timeout) must not have its speech sent on into the void."""
    from tests.netem import relayed_client

    async with (
        aiohttp.ClientSession() as http,
        relayed_client(live_server.url, http) as (client, relay),
    ):
        sid = client.session_id
        assert sid is not None
        client.send({"type": "say", "text": " ".join(["word"] * 40), "id": "long"})  # 10 s
        await client.wait_event(lambda e: e["type"] == "speech.started")
        relay.blackout = True
        await wait_for(http, live_server.url, sid, detached, 8)
        await asyncio.sleep(0.3)  # the close takes a moment
        paused = await session_state(http, live_server.url, sid)
        await asyncio.sleep(1.0)
        still = await session_state(http, live_server.url, sid)
    assert paused is not None and still is not None
    assert still["connection"] == "closed", still["connection"]
    assert still["speech_packets"] == paused["speech_packets"], (
        "speech kept being sent to a client that was gone"
    )


async def test_data_channel_messages_keep_a_peer_whose_rtcp_is_lost(
    live_server: LiveServer,
) -> None:
    """README: a connected peer from which no RTCP *and no data-channel message* came for
    --rtcp-timeout is lost. A client whose RTCP does not get through (or that sends none)
    but talks on its data channel is still there."""
    from tests.netem import relayed_client

    async with (
        aiohttp.ClientSession() as http,
        relayed_client(live_server.url, http) as (client, relay),
    ):
        sid = client.session_id
        assert sid is not None
        relay.set_drop_rtcp(True)
        relay.set_loss(upstream=1.0)  # every RTCP (and RTP) from the client dropped
        start = time.monotonic()
        while time.monotonic() - start < LIFE.rtcp_timeout_s + 2.0:
            client.send({"type": "config", "barge_in": True})
            state = await session_state(http, live_server.url, sid)
            assert state is not None and not state["detached"], (
                f"lost {time.monotonic() - start:.1f} s after its RTCP stopped, "
                "while its data channel talked"
            )
            await asyncio.sleep(0.3)
        # Silent on both: lost after the RTCP timeout.
        await wait_for(http, live_server.url, sid, detached, LIFE.rtcp_timeout_s + 3)


@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", port=0, lifecycle=LifecycleSettings(idle_timeout_s=1.5))],
)
async def test_a_data_channel_message_keeps_a_session_from_the_idle_timeout(
    live_server: LiveServer,
) -> None:
    """README, Idle: a session with no client message (a data-channel message or POST say)
    and no speech for --idle-timeout is closed. Any data-channel message (here a ``config``,
    which says nothing) is a client message."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            start = time.monotonic()
            while time.monotonic() - start < 4.0:
                client.send({"type": "config", "barge_in": True})
                await asyncio.sleep(0.3)
                closed = [e for e in client.events if e["type"] == "session.closed"]
                assert not closed, f"closed {time.monotonic() - start:.1f} s into the messages"
            quiet = time.monotonic()
            event = await client.wait_event(lambda e: e["type"] == "session.closed", 5)
            assert event == {"type": "session.closed", "reason": "idle_timeout"}
            assert time.monotonic() - quiet >= 1.0
        finally:
            await client.close()


async def test_a_resume_during_the_drain_is_told_shutting_down(live_server: LiveServer) -> None:
    """README, Shutdown: once SIGTERM's drain began, offers, WHEP posts *and resumes* get
    503 shutting_down with Retry-After (a detached session is not waited for: its resume
    is refused). Checked on a single-process server, while speech may still be draining
    (before the drain closes everything)."""
    from signaling.keys import DRAIN

    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        await first.connect()
        sid, token = first.session_id, first.session_token
        assert sid is not None
        await first.close()  # no DELETE: detached
        await wait_for(http, live_server.url, sid, detached, 5)
        live_server.app[DRAIN].draining = True  # what drain() sets first
        second = RtcClient(live_server.url, http)
        try:
            await second.connect(resume=token, allow_refusal=True)
            assert second.refusal is not None, "a resume was answered during the drain"
            status, body, headers = second.refusal
            assert (status, body["error"]["code"]) == (503, "shutting_down"), body
            assert headers["Retry-After"]
        finally:
            await second.close()


async def test_a_room_participant_s_token_is_not_resumable_and_its_seat_is_left_alone(
    live_server: LiveServer,
) -> None:
    """README: a resume is not for room participants (400 ``not_resumable``). A resume
    posted with a room seat's token (a stale page, a client that does not know) must be
    refused without touching that seat: its connection stays up, not detached."""
    async with aiohttp.ClientSession() as http:
        member = RtcClient(live_server.url, http)
        await member.connect(room="review")
        try:
            sid = member.session_id
            assert sid is not None and member.session_token
            await wait_for(
                http, live_server.url, sid, lambda s: s and s["connection"] == "connected", 5
            )
            status, body = await _post_resume(http, live_server.url, member.session_token)
            assert (status, body["error"]["code"]) == (400, "not_resumable"), body
            await asyncio.sleep(0.5)
            state = await session_state(http, live_server.url, sid)
            assert state is not None, "the seat was closed by a refused resume"
            assert state["connection"] == "connected" and not state["detached"], state
        finally:
            await member.close()


class _DrainedRegistry:
    """What drain() uses of a SessionRegistry: its peers, and close_all (recorded)."""

    def __init__(self, peers: list[Any]) -> None:
        self._peers = peers
        self.closed_at: float | None = None
        self.unsent_at_close: int | None = None

    def __len__(self) -> int:
        return len(self._peers)

    def peers(self) -> list[Any]:
        return list(self._peers)

    async def close_all(self) -> None:
        self.closed_at = time.monotonic()
        self.unsent_at_close = sum(
            p.session.channel.bufferedAmount for p in self._peers if p.session.channel
        )


def _drained_peer(*, detached_at: float | None, resuming: bool, in_flight: bool) -> Any:
    from types import SimpleNamespace

    from signaling.lifecycle import Liveness

    session = SimpleNamespace(conversation=SimpleNamespace(in_flight=in_flight), channel=None)
    return SimpleNamespace(
        life=Liveness(detached_at=detached_at), resuming=resuming, session=session
    )


async def test_the_drain_waits_for_a_session_whose_resume_was_already_negotiating() -> None:
    """README, Shutdown: a detached session is not waited for, "one whose resume was
    already being answered is": its client is coming back and its queued speech can play."""
    from signaling.shutdown import Drain, drain

    peer = _drained_peer(detached_at=time.monotonic() - 1.0, resuming=True, in_flight=True)
    registry = _DrainedRegistry([peer])

    async def speech_ends() -> None:
        await asyncio.sleep(0.6)
        peer.session.conversation.in_flight = False

    ending = asyncio.ensure_future(speech_ends())
    started = time.monotonic()
    finished = await drain(registry, Drain(), 5.0)  # type: ignore[arg-type]
    await ending
    assert registry.closed_at is not None
    waited = registry.closed_at - started
    assert waited >= 0.5, f"closed after {waited:.2f} s, with the resumed session's speech queued"
    assert finished


async def test_the_drain_gives_the_last_events_time_to_leave() -> None:
    """README, Shutdown: speech plays on until every session is idle, then the last events
    (speech.ended) get up to 1 s to leave before every peer is closed."""
    from types import SimpleNamespace

    from signaling.shutdown import Drain, drain

    peer = _drained_peer(detached_at=None, resuming=False, in_flight=False)
    peer.session.channel = SimpleNamespace(bufferedAmount=300)  # the last events, queued
    registry = _DrainedRegistry([peer])

    async def events_leave() -> None:
        await asyncio.sleep(0.3)
        peer.session.channel.bufferedAmount = 0

    leaving = asyncio.ensure_future(events_leave())
    started = time.monotonic()
    await drain(registry, Drain(), 5.0)  # type: ignore[arg-type]
    await leaving
    assert registry.unsent_at_close == 0, "peers closed with the last events still queued"
    assert registry.closed_at is not None and registry.closed_at - started < 1.2


def test_ipv4_clients_on_a_dual_stack_socket_are_each_their_own_client() -> None:
    """README, Rate limits: buckets per client address; an IPv6 client is its /64. A
    dual-stack socket shows IPv4 clients as ``::ffff:a.b.c.d``: each is still its IPv4
    address (the /64 of a mapped address is ``::ffff:0:0/96``'s, shared by every IPv4 client
    on the Internet, which would then hold one bucket between them)."""
    from agent.config import LimitSettings
    from signaling.errors import ApiError
    from signaling.limits import Limits

    slow = 0.001
    limits = Limits(LimitSettings(offer_rate=slow, offer_burst=2, speech_rate=slow, speech_burst=2))
    for address in ("::ffff:198.51.100.1", "::ffff:198.51.100.2", "::ffff:203.0.113.9"):
        limits.check_offer(address)
        limits.check_offer(address)  # each its own burst of 2
    # ... and the same client whichever way the socket shows it.
    with pytest.raises(ApiError) as refused:
        limits.check_offer("198.51.100.1")
    assert refused.value.code == "rate_limited"


def test_the_most_recently_ended_sessions_tokens_are_the_ones_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """README: after the grace a resume gets 410 session_expired; a token no session has,
    404. The book of ended tokens is bounded: what it forgets must be the oldest, not the
    session that ended a moment ago (whose client is the one most likely to come back)."""
    from signaling import resume
    from signaling.errors import ApiError

    monkeypatch.setattr(resume, "MAX_EXPIRED", 2)
    book = resume.TokenBook()
    tokens = [resume.new_token() for _ in range(3)]
    for index, token in enumerate(tokens):
        book.add(token, f"s{index}")
    for token in tokens:
        book.end(token)
    codes = []
    for token in tokens:
        with pytest.raises(ApiError) as refused:
            book.session_id(token)
        codes.append(refused.value.code)
    assert codes == ["unknown_session", "session_expired", "session_expired"]


async def test_a_resume_keeps_the_session_s_packet_counters(live_server: LiveServer) -> None:
    """GET /sessions/{id} and voice_agent_packets_sent_total (README: closed sessions
    included, so a counter) count a session's packets; a resume gives it a new track but
    the same counts: neither may go back."""
    from tests.test_metrics import scrape, value

    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        await first.connect()
        sid = first.session_id
        assert sid is not None
        first.send({"type": "say", "text": "one two three four", "id": "u1"})
        await first.wait_event(lambda e: e["type"] == "speech.ended")
        await first.close()
        await wait_for(http, live_server.url, sid, detached, 5)
        before = await session_state(http, live_server.url, sid)
        total_before = value(await scrape(http, live_server.url), "voice_agent_packets_sent_total")
        second = RtcClient(live_server.url, http)
        await second.connect(resume=first.session_token)
        try:
            after = await session_state(http, live_server.url, sid)
            total_after = value(
                await scrape(http, live_server.url), "voice_agent_packets_sent_total"
            )
        finally:
            await second.close()
    assert before is not None and after is not None
    assert before["speech_packets"] > 0
    assert after["packets"] >= before["packets"], (before["packets"], after["packets"])
    assert after["speech_packets"] >= before["speech_packets"]
    assert total_after >= total_before, (total_before, total_after)


async def test_a_resume_stops_reading_the_old_connection_s_unlistened_microphones() -> None:
    """A microphone track that is read but not listened to (listening off, or a second
    one) is drained by a task; aiortc 1.16 never ends the track of a receiver that never
    started (a resume whose answer was lost). stop_listening (a resume replacing the
    connection) must end those reads, or every such resume leaves one more task reading a
    dead track for the rest of the call."""
    from agent.config import ListenSettings
    from agent.session import AgentSession
    from tests.doubles import ToneEngine

    class NeverEnds:
        kind = "audio"

        async def recv(self) -> None:
            await asyncio.Event().wait()  # a receiver that never started: no frame, no end

    session = AgentSession("s1", ToneEngine(), Config(listen=ListenSettings(enabled=False)))
    try:
        session.listen(NeverEnds(), None, None)  # type: ignore[arg-type]
        session.listen(NeverEnds(), None, None)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert len(session._drain_tasks) == 2
        try:  # it awaits the reads it ended: one left running holds it for ever
            await asyncio.wait_for(session.stop_listening(), 2.0)
        except TimeoutError:
            pytest.fail("stop_listening waited on a microphone read it never ended")
        await asyncio.sleep(0)
        assert not session._drain_tasks, "the old connection's microphones are still read"
    finally:
        await session.close()
