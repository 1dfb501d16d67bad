"""Voice rooms end to end: several aiortc clients in one room on the real server."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from agent.config import (
    AdaptationSettings,
    Config,
    LifecycleSettings,
    RoomSettings,
    SecuritySettings,
)
from signaling.auth import mint_token
from signaling.keys import SESSIONS
from tests.conftest import LiveServer, serve
from tests.doubles import ToneEngine, ToneMicrophone, tone_frequency
from tests.rtc_client import ReceivedAudio, RtcClient, opus_fmtp_rewriter

pytestmark = pytest.mark.slow

AGENT_TEXT = "one two three four five six seven eight"  # 2 s at 460 Hz
TONE_A = 1000.0
TONE_B = 1700.0
SECRET = "r" * 32


def dominant_frequency(samples: np.ndarray, rate: int = 48_000) -> float:
    window = samples * np.hanning(len(samples))
    spectrum = np.abs(np.fft.rfft(window))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def tail(audio: ReceivedAudio, seconds: float) -> np.ndarray:
    frames = audio.frames[-int(seconds * 50) :]
    assert frames, "no audio received on this track"
    return np.concatenate(frames)


def level(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(samples**2))) if samples.size else 0.0


@contextlib.asynccontextmanager
async def room_server(
    rooms: RoomSettings | None = None, **config: object
) -> AsyncIterator[LiveServer]:
    cfg = Config(host="127.0.0.1", port=0, rooms=rooms or RoomSettings(), **config)  # type: ignore[arg-type]
    async with serve(cfg, ToneEngine()) as server:
        yield server


@pytest.mark.parametrize("direct", [True, False], ids=["direct-send", "aiortc-send"])
async def test_speakers_hear_each_other_and_the_agent_not_themselves(direct: bool) -> None:
    async with (
        room_server(RoomSettings(direct_send=direct)) as server,
        aiohttp.ClientSession() as http,
    ):
        a = RtcClient(server.url, http)
        b = RtcClient(server.url, http)
        c = RtcClient(server.url, http)
        clients = [a, b, c]
        try:
            await a.connect(room="r1", mic=ToneMicrophone(TONE_A), slots=4, name="Ada")
            await b.connect(room="r1", mic=ToneMicrophone(TONE_B), slots=4, name="Bob")
            await c.connect(room="r1", slots=4, name="Cy")  # a listener
            rooms = server.app[SESSIONS].rooms
            assert len(rooms) == 1
            room = rooms.get("r1")
            assert room is not None and len(room.members) == 3
            # Every subscriber track (agent and slots) uses the send path asked for.
            await asyncio.sleep(0.5)
            for member in room.members.values():
                assert member.track.direct is direct
            await asyncio.sleep(1.5)
            a.send({"type": "say", "text": AGENT_TEXT, "id": "hello"})
            for client in clients:
                await client.wait_event(
                    lambda e: e["type"] == "speech.started" and e["id"] == "hello"
                )
            await asyncio.sleep(1.0)
            # Mid-utterance: everybody hears the agent on the first track.
            for client in clients:
                agent = tail(client.audio, 0.6)
                assert abs(dominant_frequency(agent) - tone_frequency(AGENT_TEXT)) < 8
                assert level(agent) > 0.2
            for client in clients:
                await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=10)
        finally:
            for client in clients:
                await client.close()
    # Slot 0 is A's microphone, slot 1 B's: each reaches the others, never its owner.
    assert a.participant_id and b.participant_id and c.participant_id
    for listener, slot, tone in [(b, 0, TONE_A), (c, 0, TONE_A), (a, 1, TONE_B), (c, 1, TONE_B)]:
        heard = tail(listener.slot_audio[slot], 1.0)
        assert abs(dominant_frequency(heard) - tone) < 10, (slot, dominant_frequency(heard))
        assert level(heard) > 0.1
    assert not a.slot_audio.get(0, ReceivedAudio()).frames, "A heard its own microphone"
    assert not b.slot_audio.get(1, ReceivedAudio()).frames, "B heard its own microphone"
    assert not c.slot_audio.get(2, ReceivedAudio()).frames  # nobody holds slot 2

    # Room events: the joiner's room.state, others' participant.joined, speaker.active.
    state = next(e for e in c.events if e["type"] == "room.state")
    assert state["participant_id"] == c.participant_id
    assert {p["name"] for p in state["participants"]} == {"Ada", "Bob", "Cy"}
    roles = {p["name"]: (p["role"], p["slot"]) for p in state["participants"]}
    assert roles == {"Ada": ("speaker", 0), "Bob": ("speaker", 1), "Cy": ("listener", None)}
    joined = [e["participant_id"] for e in a.events if e["type"] == "participant.joined"]
    assert joined == [b.participant_id, c.participant_id]
    active = {
        e["participant_id"] for e in c.events if e["type"] == "speaker.active" and e["active"]
    }
    # Who was already talking when C joined is in its room.state.
    active |= {p["participant_id"] for p in state["participants"] if p["speaking"]}
    assert {a.participant_id, b.participant_id, "agent"} <= active
    # The agent's speech events reached everyone, not just the one who asked.
    for client in clients:
        kinds = [e["type"] for e in client.events if e.get("id") == "hello"]
        assert kinds[0] == "speech.started" and kinds[-1] == "speech.ended"


async def test_one_encode_per_frame_whatever_the_listeners_and_pts_per_track() -> None:
    async with room_server() as server, aiohttp.ClientSession() as http:
        clients = [RtcClient(server.url, http) for _ in range(4)]
        try:
            await clients[0].connect(room="big")
            for client in clients[1:3]:
                await client.connect(room="big")
            await clients[3].connect(room="big", whep=True)  # a WHEP guest joins too
            room = server.app[SESSIONS].rooms.get("big")
            assert room is not None
            clients[0].send({"type": "say", "text": " ".join(["word"] * 12), "id": "u"})
            await clients[0].wait_event(lambda e: e["type"] == "speech.started")
            members = list(room.members.values())
            assert len(members) == 4
            deadline = time.monotonic() + 10  # every connection up (DTLS done) and sending
            while min(m.track.stats.packets for m in members) < 5:
                assert time.monotonic() < deadline, [m.track.stats.packets for m in members]
                await asyncio.sleep(0.05)
            start_encodes = room.agent_track.stats.speech_packets
            start_published = room.agent.packets
            start_sent = [m.track.stats.packets for m in members]
            await asyncio.sleep(1.5)
            encodes = room.agent_track.stats.speech_packets - start_encodes
            published = room.agent.packets - start_published
            sent = [m.track.stats.packets - s for m, s in zip(members, start_sent, strict=True)]
            direct = [m.track.direct for m in members]
        finally:
            for client in clients:
                await client.close()
    # 50 frames a second encoded once, not once per listener; every listener got them all.
    assert 65 <= encodes <= 80, encodes
    assert 65 <= published <= 80, published
    assert min(sent) >= published - 2, (sent, published)
    assert all(direct)  # the lean send path (agent/direct.py) carried them
    for client in clients:
        pts = np.array(client.audio.pts[5:])
        assert len(pts) > 50
        assert (np.diff(pts) == 960).all(), np.unique(np.diff(pts))


def _abandon(client: RtcClient) -> None:
    """Vanish without a word: close the client's UDP sockets (no DTLS close, no DELETE)."""
    for transceiver in client.pc.getTransceivers():
        connection = transceiver.receiver.transport.transport._connection
        for protocol in connection._protocols:
            if protocol.transport is not None:
                protocol.transport.close()


async def test_a_vanished_listener_disturbs_nobody_and_the_room_closes_when_empty() -> None:
    async with room_server() as server, aiohttp.ClientSession() as http:
        speaker = RtcClient(server.url, http)
        steady = RtcClient(server.url, http)
        gone = RtcClient(server.url, http)
        await speaker.connect(room="r", mic=ToneMicrophone(TONE_A), slots=2)
        await steady.connect(room="r", slots=2)
        await gone.connect(room="r", slots=2)
        registry = server.app[SESSIONS]
        room = registry.rooms.get("r")
        assert room is not None
        try:
            await asyncio.sleep(1.0)
            _abandon(gone)
            mark = len(steady.audio.frames), len(steady.slot_audio[0].frames)
            speaker.send({"type": "say", "text": "a b c d e f g h", "id": "x"})
            await asyncio.sleep(3.0)
            agent = steady.audio
            frames = len(agent.frames) - mark[0]
            slot_frames = len(steady.slot_audio[0].frames) - mark[1]
            assert 135 <= frames <= 160, frames  # 3 s of agent packets, on time
            assert 135 <= slot_frames <= 160, slot_frames
            assert (np.diff(np.array(agent.pts[mark[0] :])) == 960).all()
            arrivals = np.array(agent.arrivals[mark[0] :])
            assert np.max(np.diff(arrivals)) < 0.25  # no stall behind the vanished one
            heard = tail(steady.slot_audio[0], 1.0)
            assert abs(dominant_frequency(heard) - TONE_A) < 10
            assert len(room.members) == 3  # the vanished one is still counted: ICE is slow
            await steady.wait_event(lambda e: e["type"] == "speech.ended", timeout=10)
        finally:
            await gone.close()
        # Everyone leaves (DELETE, as the server does itself once aioice's consent checks
        # give up on the vanished one after ~30 s; or by hanging up): the room closes.
        for client in (gone, speaker):
            async with http.delete(f"{server.url}/sessions/{client.session_id}") as resp:
                assert resp.status == 204
        await speaker.close()
        await steady.close()
        deadline = time.monotonic() + 15
        while len(registry) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(registry) == 0
        assert len(registry.rooms) == 0
        assert room.closed
        assert room.agent_track.readyState == "ended"
        assert room.agent.subscribers == 0
        assert all(feed is None for feed in room.slots)
        # A new join with the same name makes a fresh room.
        again = RtcClient(server.url, http)
        await again.connect(room="r")
        try:
            fresh = registry.rooms.get("r")
            assert fresh is not None and fresh is not room and len(fresh.members) == 1
        finally:
            await again.close()


async def test_a_speaker_whose_audio_stops_is_shown_quiet_after_the_hold() -> None:
    """A speaker whose packets stop mid-word (its network dropped) stayed "talking"
    (speaker.active, room.state's speaking) until the watchdog dropped its session: the hold
    was only checked when a frame arrived. It ends on time without frames too."""
    async with room_server() as server, aiohttp.ClientSession() as http:
        talker = RtcClient(server.url, http)
        watcher = RtcClient(server.url, http)
        late = RtcClient(server.url, http)
        try:
            await talker.connect(room="v", mic=ToneMicrophone(TONE_A), slots=1)
            await watcher.connect(room="v", slots=1)
            pid = talker.participant_id

            def shown_talking(e: dict[str, Any]) -> bool:
                if e["type"] == "room.state":  # talking before the watcher joined
                    return any(
                        p["participant_id"] == pid and p["speaking"] for p in e["participants"]
                    )
                return e["type"] == "speaker.active" and e["participant_id"] == pid and e["active"]

            await watcher.wait_event(shown_talking)
            _abandon(talker)  # its packets stop; its session lives on until the watchdog
            stopped = time.monotonic()
            off = await watcher.wait_event(
                lambda e: (
                    e["type"] in ("speaker.active", "participant.left")
                    and e["participant_id"] == pid
                    and not e.get("active", False)
                ),
                timeout=3.0,
            )
            assert off["type"] == "speaker.active", off  # quiet, not gone
            hold = RoomSettings().speaking_hold_s
            assert time.monotonic() - stopped < hold + 1.0  # the hold, a timer tick, jitter
            await late.connect(room="v", slots=1)
            state = await late.wait_event(lambda e: e["type"] == "room.state")
            talking = [p["speaking"] for p in state["participants"] if p["participant_id"] == pid]
            assert talking == [False], state
        finally:
            for client in (late, watcher, talker):
                await client.close()


async def test_a_room_where_people_talk_is_not_closed_as_idle() -> None:
    """Only requests and the agent's speech counted as activity: speakers talking to each
    other (the agent silent) were closed as idle, their listeners with them. Speech on any
    microphone now keeps every member of the room."""
    lifecycle = LifecycleSettings(idle_timeout_s=3.0)
    async with room_server(lifecycle=lifecycle) as server, aiohttp.ClientSession() as http:
        a = RtcClient(server.url, http)
        b = RtcClient(server.url, http)
        guest = RtcClient(server.url, http)  # a WHEP listener hearing them
        try:
            await a.connect(room="talk", mic=ToneMicrophone(TONE_A), slots=2)
            await b.connect(room="talk", mic=ToneMicrophone(TONE_B), slots=2)
            await guest.connect(room="talk", whep=True, slots=2)
            await a.wait_event(
                lambda e: e["type"] == "speaker.active" and e["participant_id"] == b.participant_id
            )
            await asyncio.sleep(4.5)  # longer than the idle timeout, all of it talking
            closed = [e for c in (a, b) for e in c.events if e["type"] == "session.closed"]
            assert not closed, closed
            room = server.app[SESSIONS].rooms.get("talk")
            assert room is not None and len(room.members) == 3, "room torn down as idle"
        finally:
            for client in (a, b, guest):
                await client.close()


async def test_room_limits_refuse_with_clear_errors() -> None:
    rooms = RoomSettings(max_participants=3, max_speakers=1)
    async with room_server(rooms) as server, aiohttp.ClientSession() as http:
        clients = [RtcClient(server.url, http) for _ in range(4)]
        try:
            await clients[0].connect(room="small", mic=ToneMicrophone(TONE_A), slots=1)
            error = await clients[1].connect(
                room="small", mic=ToneMicrophone(TONE_B), slots=1, expect_status=409
            )
            assert error is not None and error["error"]["code"] == "speakers_full"
            assert "listener" in error["error"]["message"]
            await clients[2].connect(room="small", slots=1)  # listeners still fit
            await clients[3].connect(room="small", whep=True)
            late = RtcClient(server.url, http)
            clients.append(late)
            error = await late.connect(room="small", expect_status=409)
            assert error is not None and error["error"]["code"] == "room_full"
            assert "3 participants" in error["error"]["message"]
            # Another room is unaffected.
            other = RtcClient(server.url, http)
            clients.append(other)
            await other.connect(room="other")
            assert len(server.app[SESSIONS].rooms) == 2
        finally:
            for client in clients:
                await client.close()


async def test_hosts_only_rooms_refuse_other_instructions() -> None:
    rooms = RoomSettings(instruct="hosts")
    security = SecuritySettings(auth_secret=SECRET)
    async with room_server(rooms, security=security) as server, aiohttp.ClientSession() as http:
        host = RtcClient(server.url, http, token=mint_token(SECRET, ttl_s=60, role="host"))
        guest = RtcClient(server.url, http, token=mint_token(SECRET, ttl_s=60, role="speaker"))
        try:
            await host.connect(room="hosted")
            await guest.connect(room="hosted")
            guest.send({"type": "say", "text": "let me talk", "id": "g"})
            error = await guest.wait_event(lambda e: e["type"] == "error")
            assert error["code"] == "forbidden" and error["id"] == "g"
            async with http.post(
                f"{server.url}/sessions/{guest.session_id}/say",
                json={"text": "over http"},
                headers={"Authorization": f"Bearer {guest.token}"},
            ) as resp:
                assert resp.status == 403
                assert (await resp.json())["error"]["code"] == "forbidden"
            # Nor through a host's session, with the guest's own token: the caller decides.
            async with http.post(
                f"{server.url}/sessions/{host.session_id}/say",
                json={"text": "through the host"},
                headers={"Authorization": f"Bearer {guest.token}"},
            ) as resp:
                assert resp.status == 403
                assert (await resp.json())["error"]["code"] == "forbidden"
            guest.send({"type": "mute", "muted": True})  # room messages stay open to all
            await host.wait_event(lambda e: e["type"] == "participant.updated" and e["muted"])
            host.send({"type": "say", "text": "welcome", "id": "h"})
            await guest.wait_event(lambda e: e["type"] == "speech.started" and e["id"] == "h")
        finally:
            await host.close()
            await guest.close()


async def test_a_freed_slot_carries_the_next_speaker_on_the_same_timeline() -> None:
    async with room_server() as server, aiohttp.ClientSession() as http:
        first = RtcClient(server.url, http)
        listener = RtcClient(server.url, http)
        second = RtcClient(server.url, http)
        try:
            await first.connect(room="relay", mic=ToneMicrophone(TONE_A), slots=1)
            await listener.connect(room="relay", slots=1)
            await asyncio.sleep(1.5)
            heard_first = tail(listener.slot_audio[0], 0.8)
            async with http.delete(f"{server.url}/sessions/{first.session_id}") as resp:
                assert resp.status == 204
            await listener.wait_event(lambda e: e["type"] == "participant.left")
            await asyncio.sleep(0.5)
            await second.connect(room="relay", mic=ToneMicrophone(TONE_B), slots=1)
            joined = await listener.wait_event(lambda e: e["type"] == "participant.joined")
            assert joined["slot"] == 0 and joined["role"] == "speaker"
            await asyncio.sleep(1.5)
            heard_second = tail(listener.slot_audio[0], 0.8)
        finally:
            for client in (first, listener, second):
                await client.close()
    assert abs(dominant_frequency(heard_first) - TONE_A) < 10
    assert abs(dominant_frequency(heard_second) - TONE_B) < 10
    # One track, two voices: its timestamps only move forward, on the 20 ms grid, and the
    # pause between the voices (over 0.5 s) shows as a gap rather than being squeezed out.
    steps = np.diff(np.array(listener.slot_audio[0].pts))
    assert (steps > 0).all() and (steps % 960 == 0).all(), np.unique(steps)
    assert steps.max() >= 960 * 25, (
        np.unique(steps),
        len(steps),
        listener.slot_audio[0].arrivals[:3],
    )


async def test_metrics_count_a_rooms_shared_agent_once() -> None:
    async with room_server() as server, aiohttp.ClientSession() as http:
        clients = [RtcClient(server.url, http) for _ in range(3)]
        try:
            for client in clients:
                await client.connect(room="m")
            room = server.app[SESSIONS].rooms.get("m")
            assert room is not None
            clients[0].send({"type": "say", "text": "one", "id": "a"})
            clients[0].send({"type": "say", "text": "two", "id": "b"})
            clients[0].send({"type": "say", "text": "three", "id": "c"})
            await clients[0].wait_event(lambda e: e["type"] == "speech.started")
            queued = room.pipeline.queued
            async with http.get(f"{server.url}/metrics") as resp:
                text = await resp.text()
        finally:
            for client in clients:
                await client.close()
    line = next(x for x in text.splitlines() if x.startswith("voice_agent_queued_utterances "))
    assert float(line.split()[1]) == queued  # once for the room, not once per participant
    sessions = [x for x in text.splitlines() if x.startswith("voice_agent_sessions_active{")]
    assert any('kind="offer"' in x and x.endswith(" 3.0") for x in sessions), sessions
    assert "\nvoice_agent_rooms_active 1.0\n" in text  # three seats, one room


async def test_config_in_a_room_sets_the_voice_and_refuses_barge_in() -> None:
    """`config` with `barge_in` in a room was an `internal` error (VoiceOptions has no such
    field): it is a 1:1 call's setting, refused as `bad_config`; voice settings still apply."""
    async with room_server() as server, aiohttp.ClientSession() as http:
        member = RtcClient(server.url, http)
        try:
            await member.connect(room="configured")
            room_member = server.app[SESSIONS].get(member.session_id).session
            member.send({"type": "config", "barge_in": False, "speed": 7})
            error = await member.wait_event(lambda e: e["type"] == "error")
            assert error["code"] == "bad_config" and "barge_in" in error["message"]
            assert room_member.pipeline.voice.speed != 7  # refused whole
            member.send({"type": "config", "speed": 7})
            member.send({"type": "say", "text": "after the config", "id": "s"})
            await member.wait_event(lambda e: e["type"] == "speech.started" and e["id"] == "s")
            assert room_member.pipeline.voice.speed == 7
            assert [e for e in member.events if e["type"] == "error"] == [error]
        finally:
            await member.close()


async def test_chat_in_a_room_is_answered_by_the_brain_for_everyone() -> None:
    """`chat` in a room only spoke its own text back, even with --llm-url: the room's agent
    now asks the brain, with the room's history, and everyone hears the reply; `interrupt`
    cancels a reply still being written."""
    from agent.conversation_config import ServiceSettings
    from tests.services import FakeLLM

    llm = FakeLLM()
    llm.replies.append(["The answer", " is four."])
    llm.replies.append(["A very", " slow", " reply", " that", " is", " cut."])
    async with llm:
        services = ServiceSettings(llm_base_url=llm.url, llm_model="m", llm_timeout_s=5.0)
        async with room_server(services=services) as server, aiohttp.ClientSession() as http:
            asker, other = RtcClient(server.url, http), RtcClient(server.url, http)
            try:
                await asker.connect(room="brainy", name="Ann")
                await other.connect(room="brainy")
                asker.send({"type": "chat", "text": "What is two plus two?"})
                for client in (asker, other):
                    caption = await client.wait_event(
                        lambda e: e["type"] == "speech.segment" and "four" in e["text"]
                    )
                    assert caption["id"].startswith("reply-")
                # Named (the brain answers a room): it can tell the askers apart.
                assert llm.requests[0]["messages"][-1] == {
                    "role": "user",
                    "content": "Ann: What is two plus two?",
                }
                await other.wait_event(
                    lambda e: e["type"] == "speech.ended" and e["id"] == caption["id"]
                )
                # The next question carries the room's history; interrupting it cancels it.
                llm.first_token_delay_s = 3.0
                other.send({"type": "chat", "text": "And three plus three?"})
                while len(llm.requests) < 2:
                    await asyncio.sleep(0.02)
                history = llm.requests[1]["messages"]
                assert {"role": "assistant", "content": "The answer is four."} in history
                # One without a name asks as "the user" does.
                assert history[-1] == {"role": "user", "content": "And three plus three?"}
                other.send({"type": "interrupt"})
                await asyncio.sleep(3.5)
                assert not [e for e in asker.events if "cut" in str(e.get("text", ""))]
                assert not [e for e in asker.events + other.events if e["type"] == "error"]
            finally:
                await asker.close()
                await other.close()


async def test_one_who_joins_while_the_agent_speaks_gets_the_utterances_start() -> None:
    """A participant who joined while the room's agent spoke got that utterance's segments
    and its end, never its start (room.state says only agent_speaking: true); found by a
    chaos run. The joiner now gets its speech.started right after room.state."""
    config = Config(host="127.0.0.1", port=0, rooms=RoomSettings())
    text = "One two three. Four five six. Seven eight nine."
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        first = RtcClient(server.url, http)
        second = RtcClient(server.url, http)
        try:
            await first.connect(room="r", slots=4, name="A")
            first.send({"type": "say", "text": text, "id": "long"})
            await first.wait_event(lambda e: e["type"] == "speech.started", 10)
            await asyncio.sleep(0.3)  # inside the first sentence
            await second.connect(room="r", slots=4, name="B")
            await second.wait_event(lambda e: e["type"] == "speech.ended", 15)
        finally:
            await first.close()
            await second.close()
    kinds = [e["type"] for e in second.events if e.get("id") == "long"]
    assert "speech.segment" in kinds, kinds
    assert kinds[0] == "speech.started" and kinds.count("speech.started") == 1, kinds
    assert kinds[-1] == "speech.ended", kinds
    order = [e["type"] for e in second.events if e["type"] in ("room.state", "speech.started")]
    assert order[:2] == ["room.state", "speech.started"], order


@pytest.mark.parametrize("adaptation", [True, False], ids=["adapting", "fixed"])
async def test_a_room_keeps_within_what_its_receiver_allows(adaptation: bool) -> None:
    """A 1:1 session codes within its receiver's fmtp: maxaveragebitrate caps the bitrate
    (adaptation on or off) and maxplaybackrate the band. A room did neither with
    --no-adaptation, and never applied maxplaybackrate: a narrow-band receiver (a SIP
    gateway at 8 kHz) was sent a full-band 32 kbps stream."""
    config = Config(
        host="127.0.0.1",
        port=0,
        rooms=RoomSettings(),
        adaptation=AdaptationSettings(enabled=adaptation),
    )
    fmtp = "useinbandfec=1;maxaveragebitrate=16000;maxplaybackrate=8000"
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        client = RtcClient(server.url, http)
        try:
            await client.connect(room="narrow", rewrite_offer=opus_fmtp_rewriter(fmtp))
            room = server.app[SESSIONS].rooms.get("narrow")
            assert room is not None
            encoder = room.agent_track.encoder
            assert encoder.bitrate <= 16_000 and encoder.max_playback_rate == 8_000
        finally:
            await client.close()


def _slots_without_opus(sdp: str) -> str:
    """Keep Opus in the first audio section (the agent's) and drop it from the later ones
    (the room's slots): a client (a SIP gateway, say) offering only G.711/G.722 for them."""
    sections = re.split(r"(?=\r\nm=)", sdp)
    out = [sections[0]]
    audio = 0
    for section in sections[1:]:
        if section.startswith("\r\nm=audio"):
            audio += 1
            if audio > 1:
                for pt in re.findall(r"a=rtpmap:(\d+) opus/", section):
                    section = re.sub(rf"\r\na=(rtpmap|fmtp|rtcp-fb):{pt} [^\r]*", "", section)
                    _, head, rest = section.split("\r\n", 2)
                    fields = head.split(" ")
                    head = " ".join(fields[:3] + [f for f in fields[3:] if f != pt])
                    section = "\r\n" + head + "\r\n" + rest
        out.append(section)
    return "".join(out)


async def test_a_slot_offered_without_opus_is_refused_not_sent_opus_under_g711() -> None:
    """A slot offered only G.722/PCMU was answered sendonly with them, and the speaker's
    Opus packets went out on it under that payload type: the listener played Opus bytes as
    G.722, noise (found by review). The slot is answered inactive; the rest of the call
    (the agent on track 0) goes on."""
    async with room_server(RoomSettings()) as server, aiohttp.ClientSession() as http:
        speaker = RtcClient(server.url, http)
        listener = RtcClient(server.url, http)
        answers: list[str] = []

        def keep(answer: str) -> str:
            answers.append(answer)
            return answer

        try:
            await speaker.connect(room="g711", mic=ToneMicrophone(TONE_A), slots=1)
            await listener.connect(
                room="g711", slots=1, rewrite_offer=_slots_without_opus, rewrite_answer=keep
            )
            listener.send({"type": "say", "text": "one two three"})
            await listener.wait_event(lambda e: e["type"] == "speech.ended", timeout=20)
            heard = listener.slot_audio.get(0)
            frames = len(heard.frames) if heard is not None else 0
        finally:
            await speaker.close()
            await listener.close()
    slot = [s for s in answers[0].split("\r\nm=")[1:] if s.startswith("audio")][1]
    codecs = re.findall(r"a=rtpmap:\d+ ([^/]+)/", slot)
    assert "opus" not in codecs and "a=inactive" in slot, (codecs, slot)
    assert frames == 0, f"{frames} frames received on the refused slot"
