"""Reconnect: a client that lost its connection resumes its session with the session token.

Same session id, same queue, same voice; what was queued while it was gone plays when it is
back (playout pauses while no peer is connected)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiortc import RTCPeerConnection
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RtcpReceiverInfo, RtcpRrPacket

from agent.adaptation import ReceiverOpus
from agent.config import Config, LifecycleSettings, LimitSettings
from agent.session import AgentSession
from signaling.keys import SESSIONS
from tests.clips import SPEECH_WAV, read_wav
from tests.conftest import LiveServer
from tests.doubles import RtcpSender, ToneEngine, tone_frequency
from tests.mic import ClipMic
from tests.netem import relayed_client
from tests.rtc_client import RtcClient
from tests.test_lifecycle import detached, gone, session_state, wait_for
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.timeout(60)

LIFE = LifecycleSettings(connect_timeout_s=5, rtcp_timeout_s=3, resume_grace_s=5, idle_timeout_s=0)


@pytest.fixture
def server_config() -> Config:
    return Config(host="127.0.0.1", port=0, lifecycle=LIFE)


def voiced_seconds(audio: np.ndarray) -> float:
    frames = audio[: len(audio) // 960 * 960].reshape(-1, 960)
    return float((np.sqrt((frames**2).mean(axis=1)) > 0.05).sum()) * 0.02


def has_tone(audio: np.ndarray, freq: float) -> bool:
    """Is there a stretch of ``freq`` (a ToneEngine utterance) in ``audio``?"""
    window = 4800  # 100 ms
    for start in range(0, len(audio) - window, window):
        chunk = audio[start : start + window]
        if np.sqrt((chunk**2).mean()) < 0.05:
            continue
        spectrum = np.abs(np.fft.rfft(chunk * np.hanning(window)))
        peak = np.fft.rfftfreq(window, 1 / 48_000)[int(np.argmax(spectrum))]
        if abs(peak - freq) < 15:
            return True
    return False


TEXTS = {
    "u1": "one two three four",
    "u2": "a b c d e f",
    "u3": "a b c d e f g h i j",
}


async def test_resume_after_a_hang_up_plays_the_queued_speech(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        await first.connect()
        assert first.session_token and len(first.session_token) >= 40
        for utt_id, text in TEXTS.items():
            first.send({"type": "say", "text": text, "id": utt_id})
        await first.wait_event(lambda e: e == {"type": "speech.started", "id": "u1"})
        await first.close()  # the connection drops mid-utterance, no DELETE
        sid = first.session_id
        assert sid is not None
        await wait_for(http, live_server.url, sid, detached, 5)
        paused = await session_state(http, live_server.url, sid)
        await asyncio.sleep(1.0)
        still = await session_state(http, live_server.url, sid)
        assert paused is not None and still is not None
        # Nothing is sent while nobody listens: the speech waits.
        assert still["speech_packets"] == paused["speech_packets"]

        second = RtcClient(live_server.url, http)
        await second.connect(resume=first.session_token)
        try:
            assert second.session_id == sid
            assert second.session_token == first.session_token
            ended: dict[str, Any] = {}
            for utt_id in ("u1", "u2", "u3"):
                event = await second.wait_event(
                    lambda e, u=utt_id: e["type"] == "speech.ended" and e["id"] == u, 15
                )
                ended[utt_id] = event
            await asyncio.sleep(0.2)
            audio = second.audio.samples()
        finally:
            await second.close()
    assert not any(e["interrupted"] for e in ended.values())
    started = [e["id"] for e in second.events if e["type"] == "speech.started"]
    assert started == ["u2", "u3"]  # u1 had started before the hang-up
    assert not any(e["type"] == "error" for e in second.events)
    # u2 and u3 were heard in full by the resumed client (4 s of tone), at their pitch.
    assert voiced_seconds(audio) >= 0.9 * 0.25 * 16
    assert has_tone(audio, tone_frequency(TEXTS["u2"]))
    assert has_tone(audio, tone_frequency(TEXTS["u3"]))


async def test_resume_before_the_server_noticed(live_server: LiveServer) -> None:
    """The client's network died (relay blackout) and it comes back on another path at
    once: the server drops the old connection for the new one."""
    async with aiohttp.ClientSession() as http:
        async with relayed_client(live_server.url, http) as (client, relay):
            client.send({"type": "say", "text": "a b c d e f g h", "id": "long"})
            await client.wait_event(lambda e: e["type"] == "speech.started")
            relay.blackout = True
            token, sid = client.session_token, client.session_id
        back = RtcClient(live_server.url, http)
        await back.connect(resume=token)
        try:
            assert back.session_id == sid
            event = await back.wait_event(lambda e: e["type"] == "speech.ended", 10)
            assert event == {"type": "speech.ended", "id": "long", "interrupted": False}
            back.send({"type": "say", "text": "again", "id": "next"})
            await back.wait_event(lambda e: e == {"type": "speech.started", "id": "next"})
            state = await session_state(http, live_server.url, sid)  # type: ignore[arg-type]
            assert state is not None and not state["detached"]
        finally:
            await back.close()


async def test_whep_sessions_resume_with_the_header(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        await first.connect(whep=True)
        assert first.session_token and first.session_id is not None
        await wait_for(
            http, live_server.url, first.session_id, lambda s: s["connection"] == "connected", 5
        )
        await first.close()
        await wait_for(http, live_server.url, first.session_id, detached, 5)
        second = RtcClient(live_server.url, http)
        await second.connect(whep=True, resume=first.session_token)
        try:
            assert second.session_id == first.session_id
            async with http.post(
                f"{live_server.url}/sessions/{second.session_id}/say", json={"text": "hi there"}
            ) as resp:
                assert resp.status == 202
            await asyncio.sleep(1.0)
            assert voiced_seconds(second.audio.samples()) > 0.2
            # A resume is no new session: it is counted apart.
            samples = await scrape(http, live_server.url)
            assert value(samples, "voice_agent_offers_total", kind="whep", outcome="answered") == 1
            assert value(samples, "voice_agent_resumes_total", kind="whep", outcome="answered") == 1
        finally:
            await second.close()


async def test_a_resume_is_counted_apart_from_new_sessions(live_server: LiveServer) -> None:
    """voice_agent_offers_total counts new sessions; a resume (the page resumes by itself,
    up to 3 tries per lost connection) was counted as one more answered offer, so a
    dashboard of sessions opened read a flaky network's reconnects."""
    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        await first.connect()
        assert first.session_id is not None
        await first.close()  # no DELETE: detached
        await wait_for(http, live_server.url, first.session_id, detached, 5)
        second = RtcClient(live_server.url, http)
        await second.connect(resume=first.session_token)
        try:
            assert second.session_id == first.session_id
            samples = await scrape(http, live_server.url)
        finally:
            await second.close()
    assert value(samples, "voice_agent_offers_total", kind="offer", outcome="answered") == 1
    assert value(samples, "voice_agent_resumes_total", kind="offer", outcome="answered") == 1


async def post_resume(http: aiohttp.ClientSession, url: str, token: object) -> tuple[int, Any]:
    client = RtcClient(url, http)
    client.pc.addTransceiver("audio", direction="recvonly")
    await client.pc.setLocalDescription(await client.pc.createOffer())
    body = {"type": "offer", "sdp": client.pc.localDescription.sdp, "resume": token}
    try:
        async with http.post(url + "/offer", json=body) as resp:
            return resp.status, await resp.json()
    finally:
        await client.close()


@pytest.mark.parametrize(
    "server_config",
    [
        Config(
            host="127.0.0.1",
            port=0,
            lifecycle=LifecycleSettings(resume_grace_s=0.5),
            limits=LimitSettings(offer_burst=100),
        )
    ],
)
async def test_tokens_after_the_grace_wrong_or_malformed_are_refused(
    live_server: LiveServer,
) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        await client.close()
        assert client.session_id is not None
        await wait_for(http, live_server.url, client.session_id, gone, 5)
        status, body = await post_resume(http, live_server.url, client.session_token)
        assert status == 410 and body["error"]["code"] == "session_expired"
        status, body = await post_resume(http, live_server.url, "x" * 43)
        assert status == 404 and body["error"]["code"] == "unknown_session"
        for bad in (42, "", None, ["t"], "\ud800" * 3, "y" * 300):
            status, body = await post_resume(http, live_server.url, bad)
            assert (status, body["error"]["code"]) in ((400, "bad_token"), (404, "unknown_session"))
        # A WHEP token cannot take over an /offer session, and the reverse.
        whep = RtcClient(live_server.url, http)
        await whep.connect(whep=True)
        try:
            status, body = await post_resume(http, live_server.url, whep.session_token)
            assert status == 400 and body["error"]["code"] == "wrong_kind"
        finally:
            await whep.close()
        # Refused resumes are refused resumes, not refused new sessions.
        samples = await scrape(http, live_server.url)
    offers = {k: v for k, v in samples.items() if k[0] == "voice_agent_offers_total" and v}
    assert offers == {
        ("voice_agent_offers_total", (("kind", "offer"), ("outcome", "answered"))): 1,
        ("voice_agent_offers_total", (("kind", "whep"), ("outcome", "answered"))): 1,
    }
    resumes = {
        dict(k[1])["outcome"]: v for k, v in samples.items() if k[0] == "voice_agent_resumes_total"
    }
    assert resumes["rejected_session_expired"] == 1 and resumes["rejected_wrong_kind"] == 1
    assert resumes["rejected_unknown_session"] + resumes.get("rejected_bad_token", 0) == 7


async def test_a_resume_after_the_grace_is_refused_before_the_watchdog_looks(
    live_server: LiveServer,
) -> None:
    """README: after --resume-grace, 410 session_expired. The grace was enforced only by the
    watchdog, once a second: a resume in between took the expired session over (found by
    review). Here the watchdog never looks, and the session's grace ran out a moment ago."""
    registry = live_server.app[SESSIONS]
    registry._check_all = lambda: None  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        await client.close()  # no DELETE: the server sees the connection go
        sid = client.session_id
        assert sid is not None
        peer = registry.get(sid)
        async with asyncio.timeout(10):
            while peer.life.detached_at is None:
                await asyncio.sleep(0.02)
        peer.life.detached_at = time.monotonic() - LIFE.resume_grace_s - 0.05
        status, body = await post_resume(http, live_server.url, client.session_token)
        assert (status, body["error"]["code"]) == (410, "session_expired"), body
        await wait_for(http, live_server.url, sid, gone, 5)  # and it is closed


@pytest.mark.parametrize("when", ["old_pc_closed", "negotiating", "negotiated"])
async def test_a_session_closed_during_its_resume_is_not_resumed(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """DELETE (or the watchdog) landing while a resume awaits: it used to get a 500 (the
    negotiation hit the closed session's encoder), or a 200 and a new peer connection that
    nothing ever closed. Now: 410 session_expired, and every peer connection is closed."""
    from signaling import sessions

    registry = live_server.app[SESSIONS]
    made: list[RTCPeerConnection] = []
    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        await first.connect()
        sid = first.session_id
        assert sid is not None
        peer = registry.get(sid)
        old_pc = peer.pc

        async def delete() -> None:
            async with http.delete(f"{live_server.url}/sessions/{sid}") as resp:
                assert resp.status == 204

        real_close = sessions.close_peer_connection

        async def close_then_delete(pc: RTCPeerConnection) -> None:
            await real_close(pc)
            if pc is old_pc and peer.resuming and registry.peers():
                await delete()  # lands after the resume closed the old connection

        real_connect = registry._connect

        async def connect(*args: Any) -> tuple[RTCPeerConnection, str]:
            if when == "negotiating":
                await delete()  # the new negotiation meets a closed session
            pc, answer = await real_connect(*args)
            made.append(pc)
            if when == "negotiated":
                await delete()
            return pc, answer

        if when == "old_pc_closed":
            monkeypatch.setattr(sessions, "close_peer_connection", close_then_delete)
        monkeypatch.setattr(registry, "_connect", connect)
        second = RtcClient(live_server.url, http)
        try:
            # With a microphone: the negotiation starts listening to it, on the closed session.
            await second.connect(resume=first.session_token, mic=ClipMic(), allow_refusal=True)
            assert second.refusal is not None, "a deleted session was resumed"
            status, body, _ = second.refusal
            assert (status, body["error"]["code"]) == (410, "session_expired"), body
            assert len(registry) == 0
            assert [pc.connectionState for pc in made] == ["closed"] * len(made)
            inbound = peer.session.inbound  # type: ignore[union-attr]
            assert inbound is None or not inbound._tasks, "the new microphone is still read"
            status, body = await post_resume(http, live_server.url, first.session_token)
            assert (status, body["error"]["code"]) == (410, "session_expired")
        finally:
            await first.close()
            await second.close()


async def _wait_listening(http: aiohttp.ClientSession, url: str, sid: str) -> None:
    """Until the session's microphone is being scored (the VAD is loaded and running)."""
    deadline = time.monotonic() + 30
    while True:
        state = await session_state(http, url, sid)
        assert state is not None
        inbound = state["inbound"]
        if inbound and inbound["ready"] and inbound["windows"] > 5:
            return
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.1)


async def _inbound_frames(http: aiohttp.ClientSession, url: str, sid: str) -> int:
    state = await session_state(http, url, sid)
    assert state is not None and state["inbound"] is not None, state
    return int(state["inbound"]["frames"])


async def _resume_and_lose_the_answer(http: aiohttp.ClientSession, url: str, token: str) -> None:
    """A resume offer with a microphone whose answer never reaches the client (the network
    dropped again): the server's new peer connection never connects."""
    lost = RtcClient(url, http)
    lost.pc.addTransceiver(ClipMic(), direction="sendrecv")
    lost.pc.createDataChannel("agent")
    await lost.pc.setLocalDescription(await lost.pc.createOffer())
    body: dict[str, Any] = {"type": "offer", "sdp": lost.pc.localDescription.sdp, "resume": token}
    async with http.post(url + "/offer", json=body) as resp:
        assert resp.status == 200, await resp.text()
    await lost.close()


async def test_a_retried_resume_listens_to_the_retry_s_microphone(
    live_server: LiveServer,
) -> None:
    """Bug: after a resume whose answer got lost (README: it can be tried again), the retry's
    microphone was only drained, never listened to: no VAD, turns or barge-in for the rest of
    the call. The session waited for the lost connection's track to end before switching,
    and in aiortc 1.16 the track of a receiver that never started never ends."""
    samples, rate = read_wav(SPEECH_WAV)
    async with aiohttp.ClientSession() as http:
        first = RtcClient(live_server.url, http)
        first.mic = ClipMic()
        await first.connect()
        sid, token = first.session_id, first.session_token
        assert sid is not None and token is not None
        await _wait_listening(http, live_server.url, sid)
        await first.close()

        await _resume_and_lose_the_answer(http, live_server.url, token)

        second = RtcClient(live_server.url, http)
        second.mic = ClipMic()
        await second.connect(resume=token)
        try:
            assert second.session_id == sid
            await asyncio.sleep(1.0)
            before = await _inbound_frames(http, live_server.url, sid)
            await asyncio.sleep(1.0)
            after = await _inbound_frames(http, live_server.url, sid)
            assert after > before + 20, (
                f"the resumed microphone is not listened to: {before} -> {after} frames"
            )
            second.mic.play(samples, rate)
            await second.wait_event(lambda e: e["type"] == "user.speech.started", timeout=5)
        finally:
            await second.close()


async def _lossy_session() -> tuple[AgentSession, RtcpSender]:
    """A session whose (fake) sender heard 10% loss: FEC on, bitrate lowered soon."""
    session = AgentSession("s1", ToneEngine(), Config())
    sender = RtcpSender()
    transceiver = SimpleNamespace(sender=sender)
    session.attach_sender(transceiver, ReceiverOpus(fec=True))  # type: ignore[arg-type]
    await sender._handle_rtcp_packet(_report(sender, fraction_lost=26))
    assert session.track.encoder.fec
    return session, sender


def _report(sender: RtcpSender, fraction_lost: int) -> RtcpRrPacket:
    info = RtcpReceiverInfo(
        ssrc=sender._ssrc,
        fraction_lost=fraction_lost,
        packets_lost=0,
        highest_sequence=0,
        jitter=0,
        lsr=0,
        dlsr=0,
    )
    return RtcpRrPacket(ssrc=99, reports=[info])


def _tap_errors(session: AgentSession) -> int:
    assert session.network.tap is not None
    return session.network.tap.errors


async def test_adaptation_leaves_the_stopped_track_alone_while_a_resume_is_awaited() -> None:
    """The connection drops: aiortc stops the track, closing its encoder. The session waits
    for a resume with its stats loop ticking the adaptation every second; when the target
    changes then (FEC off 10 s after the loss) it must not reach the closed encoder (it
    raised OpusError, logged with a traceback every second until the session ended)."""
    session, sender = await _lossy_session()
    try:
        session.track.stop()
        session.network.controller._last_loss_time -= 11  # the FEC hold-off is over
        for _ in range(3):  # what _stats_loop does once a second
            session.network.tick()
        # Nor does a report still in flight when the connection went.
        await sender._handle_rtcp_packet(_report(sender, fraction_lost=0))
        assert _tap_errors(session) == 0
        assert session.network_stats()["fec"]  # the stopped encoder's last settings
    finally:
        await session.close()


async def test_a_renewed_track_gets_a_fresh_adaptation_until_its_connection_attaches() -> None:
    """A resume renews the track before negotiating; if the negotiation fails the session
    waits on, and its adaptation must be the new track's (not the stopped one's)."""
    session, _ = await _lossy_session()
    try:
        before = time.monotonic()
        session.renew_track()
        # What waited for the resume is no engine latency: first audio counts from here.
        assert session.pipeline._last_ended_at >= before
        network = session.network
        assert network.track is session.track
        assert network.tap is None and network.controller.loss is None
        stats = session.network_stats()
        assert not stats["fec"] and not stats["adaptive"] and stats["encoder_changes"] == 0
        network.tick()  # the stats loop's tick: nothing attached, nothing to do
        transceiver = SimpleNamespace(sender=RtcpSender())
        session.attach_sender(transceiver, ReceiverOpus(fec=True))  # type: ignore[arg-type]
        assert session.network.track is session.track and session.network.tap is not None
    finally:
        await session.close()


async def test_a_renewed_track_keeps_its_early_send_on_speech_onset() -> None:
    """renew_track stops the old track while its recv may be waiting for its tick with the
    playout buffer's onset hook set; that wait only ends at the loop's next step, and its
    cleanup must not unhook the hook the new track set in the meantime (it did: the new
    track then sent the first speech after a resume at its tick, up to 20 ms late)."""
    session = AgentSession("s1", ToneEngine(), Config())
    try:
        buffer = session.pipeline.buffer
        old = session.track
        await old.recv()  # the first packet goes at once; the next waits for its tick
        waiting = asyncio.ensure_future(old.recv())
        await asyncio.sleep(0.005)
        assert buffer.on_arrival is not None  # idle: speech arriving would go out at once
        session.renew_track()
        new = session.track
        await new.recv()  # at once, in the loop step of the renew
        speech = np.full(buffer.sample_rate // 50, 3_000, dtype=np.int16)
        loop = asyncio.get_running_loop()
        loop.call_later(0.002, lambda: asyncio.ensure_future(buffer.put(speech)))
        # Its wait starts in this step too, before the old track's wait has ended.
        await new.recv()
        with pytest.raises(MediaStreamError):
            await waiting
        assert new.stats.speech_packets == 1
        assert new.stats.early_rephases == 1  # sent when it arrived, not at the tick
    finally:
        await session.close()
